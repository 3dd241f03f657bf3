"""A small inventory tool: `python3 inventory.py stock.csv ITEM` prints how many ITEM are in stock."""

import csv
import os
import sys


def count(path: str, item: str) -> int:
    with open(path, newline="") as source:
        return sum(int(row["quantity"]) for row in csv.DictReader(source) if row["item"] == item)


if __name__ == "__main__":
    path, item = sys.argv[1], sys.argv[2]
    print(f"{count(path, item)} {os.environ.get('REPORT_UNIT', '')}".strip())
