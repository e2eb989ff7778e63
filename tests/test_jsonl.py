"""poss.jsonl.read_jsonl: plain and xz-compressed files, a missing file, a line cut short by a kill."""

import json
import lzma

from poss.jsonl import read_jsonl


def test_reads_plain_and_xz_and_skips_a_cut_line(tmp_path):
    recs = [{"key": 1, "split": "val"}, {"key": 0, "split": "train"}]
    text = "".join(json.dumps(r) + "\n" for r in recs) + '{"key": 2, "spl'  # the last line was cut by a kill
    (tmp_path / "records.jsonl").write_text(text)
    (tmp_path / "records.jsonl.xz").write_bytes(lzma.compress(text.encode()))
    assert read_jsonl(tmp_path / "records.jsonl") == recs
    assert read_jsonl(tmp_path / "records.jsonl.xz") == recs
    assert read_jsonl(tmp_path / "absent.jsonl") == []
