"""Write the tiny sums task as Parquet files with other column names than mars-megatron's defaults, the
way a dataset from the Hub often comes: the problem as a chat list, the answer nested, an id and a source
column. ``examples/byot/byot_cpu.yaml`` maps them (``data.fields``); ``scripts/demo.sh`` with
``TASK=byot`` runs this first.

    python examples/byot/make_data.py OUT_DIR      # writes OUT_DIR/train.parquet and OUT_DIR/test.parquet
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DATA = Path(__file__).resolve().parents[1] / "data"


def rows(jsonl: Path) -> list[dict]:
    out = []
    for line in jsonl.read_text().splitlines():
        r = json.loads(line)
        out.append(
            {
                "uid": r["qid"],
                "messages": [{"role": "user", "content": r["problem"]}],
                "target": {"value": str(r["answer"]), "kind": "integer"},
                "source": "sums",
            }
        )
    return out


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for split, jsonl in (("train", DATA / "arith_train.jsonl"), ("test", DATA / "arith_test.jsonl")):
        pq.write_table(pa.Table.from_pylist(rows(jsonl)), out / f"{split}.parquet")
        print(f"wrote {out / f'{split}.parquet'}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))
