"""Sharded runs: merge the timings of N CI jobs (one per shard) into one run.

A suite split over N runners (a CI matrix with pytest's node lists, ``-k``
or pytest-split; pytest-xdist inside each) produces one run document per
shard (``pytest --forkd-json=shard-K.json``). Merged, they are one run whose
sample counts are the sum of the shards', so a baseline and the gate see the
whole suite: a regression present in one shard only still moves its tests'
rows and the whole-run figures.

Merging refuses shards that did not run the same thing: other snapshot
recipe hashes (one shard rebuilt a snapshot instead of importing the shared
one) or other run conditions (accelerator, backend, snapshot, pool). Each
shard's machine info, commit and time travel with the merged run under
``shards``, and each sample names its shard.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pytest_forkd.errors import ConfigError
from pytest_forkd.latency.runs import FORMAT_VERSION, in_report_order, load_run, summary_section

#: machine_info keys whose value differs between shards are kept as the sorted list of values.
_MIXED_NOTE = "differs between shards; see shards[].machine_info"


def expand_run_paths(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """Run files named directly, plus every ``*.json`` inside a named directory (sorted)."""
    found: list[Path] = []
    for entry in map(Path, paths):
        if entry.is_dir():
            inside = sorted(path for path in entry.glob("*.json") if path.is_file())
            if not inside:
                raise ConfigError(
                    f"{entry}: no run files (*.json) in this directory; "
                    "give the files written by --forkd-json or --forkd-save"
                )
            found += inside
        else:
            found.append(entry)
    return found


def load_runs(paths: Iterable[str | os.PathLike[str]]) -> dict[str, Any]:
    """Load one run, or merge several (files, or directories of them) into one."""
    files = expand_run_paths(paths)
    if not files:
        raise ConfigError("no run files given")
    documents = [(str(path), load_run(path)) for path in files]
    if len(documents) == 1:
        return documents[0][1]
    return merge_runs(documents)


def merge_runs(documents: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, object]:
    """One run document holding every sample of ``documents`` (``(label, document)`` pairs, one per shard).

    Raises ConfigError naming the shards when their snapshot recipe hashes or
    their run conditions differ.
    """
    if not documents:
        raise ConfigError("nothing to merge: give at least one run file")
    shards = [shard for label, document in documents for shard in _as_shards(label, document)]
    _refuse_different_recipes(shards)
    _refuse_different_conditions(shards)
    samples: list[dict[str, Any]] = []
    by_op: dict[str, list[float]] = {}
    by_test: dict[str, dict[str, list[float]]] = {}
    for shard in shards:
        for op, section in _mapping(shard["operations"]).items():
            by_op.setdefault(op, []).extend(_values(section))
        for test, sections in _mapping(shard["tests"]).items():
            for op, section in _mapping(sections).items():
                by_test.setdefault(test, {}).setdefault(op, []).extend(_values(section))
        samples += [{**sample, "shard": sample.get("shard", shard["label"])} for sample in shard["samples"]]
    first = shards[0]
    merged: dict[str, object] = {
        "version": FORMAT_VERSION,
        "machine_info": _common_machine_info([shard["machine_info"] for shard in shards]),
    }
    commits = {str(_mapping(shard.get("commit_info")).get("id")) for shard in shards if shard.get("commit_info")}
    if first.get("commit_info") and len(commits) == 1:
        merged["commit_info"] = first["commit_info"]
    times = sorted(str(shard["datetime"]) for shard in shards if shard.get("datetime"))
    merged.update(
        {
            "datetime": times[-1] if times else datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "conditions": dict(_mapping(first.get("conditions"))),
            "snapshots": _merged_recipes(shards),
            "operations": {op: summary_section(values) for op, values in in_report_order(by_op)},
            "tests": {
                test: {op: summary_section(values) for op, values in in_report_order(ops)}
                for test, ops in sorted(by_test.items())
            },
            "samples": samples,
            "shards": [
                {
                    key: shard[key]
                    for key in (
                        "label",
                        "machine_info",
                        "commit_info",
                        "datetime",
                        "conditions",
                        "snapshots",
                        "sample_count",
                    )
                    if shard.get(key) is not None
                }
                for shard in shards
            ],
        }
    )
    return merged


def _as_shards(label: str, document: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A run as the list of its shards (a merged run contributes the shards it was made of)."""
    operations = _mapping(document.get("operations"))
    count = sum(len(_values(section)) for section in operations.values())
    own = {
        "label": label,
        "machine_info": dict(_mapping(document.get("machine_info"))),
        "commit_info": document.get("commit_info"),
        "datetime": document.get("datetime"),
        "conditions": dict(_mapping(document.get("conditions"))),
        "snapshots": dict(_mapping(document.get("snapshots"))),
        "sample_count": count,
        "operations": operations,
        "tests": _mapping(document.get("tests")),
        "samples": [dict(sample) for sample in document.get("samples", []) if isinstance(sample, Mapping)],
    }
    if not document.get("shards"):
        return [own]
    # Already merged: its operations hold every shard's samples; keep the shard list for the record.
    own["merged_from"] = [shard.get("label") for shard in document["shards"] if isinstance(shard, Mapping)]
    return [own]


def _refuse_different_recipes(shards: list[dict[str, Any]]) -> None:
    seen: dict[str, tuple[str, str]] = {}
    for shard in shards:
        for tag, recipe_hash in shard["snapshots"].items():
            if recipe_hash is None:
                continue
            if tag in seen and seen[tag][0] != recipe_hash:
                other_hash, other_label = seen[tag]
                raise ConfigError(
                    f"shards ran different builds of snapshot {tag!r}: recipe {other_hash} in {other_label}, "
                    f"{recipe_hash} in {shard['label']}; build and export the snapshots once and import the same "
                    "archive in every shard (see examples/ci/forkd-matrix.yml)"
                )
            seen.setdefault(tag, (recipe_hash, shard["label"]))


def _refuse_different_conditions(shards: list[dict[str, Any]]) -> None:
    first = shards[0]
    for shard in shards[1:]:
        keys = sorted(set(first["conditions"]) | set(shard["conditions"]))
        for key in keys:
            if first["conditions"].get(key) != shard["conditions"].get(key):
                raise ConfigError(
                    f"shards ran under different conditions: {key} is {first['conditions'].get(key)!r} in "
                    f"{first['label']} and {shard['conditions'].get(key)!r} in {shard['label']}; run every shard "
                    f"with the same forkd settings (their latencies are not comparable otherwise)"
                )


def _merged_recipes(shards: list[dict[str, Any]]) -> dict[str, object]:
    recipes: dict[str, object] = {}
    for shard in shards:
        for tag, recipe_hash in shard["snapshots"].items():
            if recipes.get(tag) is None:
                recipes[tag] = recipe_hash
    return recipes


def _common_machine_info(infos: list[dict[str, Any]]) -> dict[str, object]:
    """The machine info all shards share; a key whose value differs holds the sorted distinct values."""
    merged: dict[str, object] = {}
    for key in sorted({key for info in infos for key in info}, key=str):
        values = [info.get(key) for info in infos]
        distinct = sorted({repr(value): value for value in values}.items())
        merged[key] = values[0] if len(distinct) == 1 else [value for _text, value in distinct]
    if any(isinstance(value, list) for key, value in merged.items() if key != "node"):
        merged["note"] = _MIXED_NOTE
    return merged


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _values(section: object) -> list[float]:
    samples = _mapping(section).get("samples")
    return [float(value) for value in samples] if isinstance(samples, list) else []
