"""``poss demo``: verify a small draft tree with the tree_verify kernel (no model needed)."""


def add_parser(sub):
    return sub.add_parser("demo", help="verify a small draft tree with the tree_verify kernel")


def run(args) -> int:
    from poss.demo import main as demo

    return demo()
