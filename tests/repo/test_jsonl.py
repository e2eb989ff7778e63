"""poss.jsonl: plain and xz-compressed files, a missing file, a line cut short by a kill, appending after one."""

import json
import lzma

from poss.jsonl import open_for_append, read_jsonl


def test_reads_plain_and_xz_and_skips_a_cut_line(tmp_path):
    recs = [{"key": 1, "split": "val"}, {"key": 0, "split": "train"}]
    text = "".join(json.dumps(r) + "\n" for r in recs) + '{"key": 2, "spl'  # the last line was cut by a kill
    (tmp_path / "records.jsonl").write_text(text)
    (tmp_path / "records.jsonl.xz").write_bytes(lzma.compress(text.encode()))
    assert read_jsonl(tmp_path / "records.jsonl") == recs
    assert read_jsonl(tmp_path / "records.jsonl.xz") == recs
    assert read_jsonl(tmp_path / "absent.jsonl") == []


def test_appending_after_a_cut_line_loses_no_record(tmp_path):
    a, b, c = ({"key": k} for k in range(3))
    for before in (json.dumps(a) + "\n" + json.dumps(b)[:5],  # cut after a complete record
                   json.dumps(b)[:5]):  # cut in the very first record
        p = tmp_path / "r.jsonl"
        p.write_text(before)
        kept = [r for r in read_jsonl(p)]
        with open_for_append(p) as f:
            for r in (b, c):
                f.write(json.dumps(r) + "\n")
        assert read_jsonl(p) == kept + [b, c]
    with open_for_append(tmp_path / "new.jsonl") as f:  # a missing file is created
        f.write(json.dumps(a) + "\n")
    assert read_jsonl(tmp_path / "new.jsonl") == [a]
