"""Schemas nobody tuned for: the JSON-Schema-Test-Suite's test-case schemas (JSONSchemaBench's
"Synthesized" family, which ../shared/data/jsonschemabench does not hold) as a data folder that
`plait bench structured --data` reads, in the shared sample's layout (index.json, <subset>/<name>.json
with the schema and its test instances).

    pip download --no-deps --no-binary :all: jsonschema==4.17.3 -d /tmp/suite    # vendors the suite
    tar xzf /tmp/suite/jsonschema-4.17.3.tar.gz -C /tmp/suite
    python scripts/build_suite_schemas.py /tmp/suite/jsonschema-4.17.3/json/tests /tmp/suite/data
    plait bench structured --data /tmp/suite/data --subset synth --no-throughput

Kept, of drafts 2020-12 and 2019-09 (required files and optional/format): object schemas with at least
one valid instance that need no other document (no refRemote / vocabulary, no reference to a
resource the schema does not declare), once each. Subset `synth`: a fixed sample of up to 4 groups per
keyword file, 150 in all, taken round-robin over the files so that every keyword is there; `synth_extra`:
the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path
from urllib.parse import urldefrag, urljoin

PER_FILE, CAP, SEED = 4, 150, 20250121


def needs_other_document(schema) -> bool:
    """Whether a reference of the schema names a resource it does not hold."""
    ids, targets = {""}, []

    def visit(node, base: str) -> None:
        if isinstance(node, list):
            for x in node:
                visit(x, base)
        elif isinstance(node, dict):
            if isinstance(node.get("$id"), str):
                base = urljoin(base, node["$id"])
                ids.add(urldefrag(base)[0])
            for key in ("$ref", "$dynamicRef", "$recursiveRef"):
                if isinstance(node.get(key), str):
                    targets.append(urldefrag(urljoin(base, node[key]))[0])
            for k, v in node.items():
                if k not in ("const", "enum", "default", "examples"):
                    visit(v, base)

    visit(schema, "")
    return any(t not in ids for t in targets)


def eligible(tests: Path) -> dict[str, list]:
    """keyword file -> [(draft, file, group index, group)] of the groups worth a request."""
    seen, kept = set(), {}
    for draft in ("draft2020-12", "draft2019-09"):
        root = tests / draft
        for path in sorted(root.glob("*.json")) + sorted(root.glob("optional/format/*.json")):
            stem = str(path.relative_to(root))[:-5].replace("optional/format/", "format-")
            if stem in ("refRemote", "vocabulary"):  # other documents, a custom metaschema
                continue
            for i, group in enumerate(json.loads(path.read_text())):
                schema = group["schema"]
                if not isinstance(schema, dict) or not any(t["valid"] for t in group["tests"]):
                    continue
                if needs_other_document(schema):
                    continue
                key = json.dumps({k: v for k, v in schema.items() if k != "$schema"}, sort_keys=True)
                if key not in seen:
                    seen.add(key)
                    kept.setdefault(stem, []).append((draft, stem, i, group))
    return kept


def sample(kept: dict[str, list]) -> list:
    """Up to PER_FILE groups a file, CAP in all, a round over the files (in a shuffled order) at a time."""
    rng = random.Random(SEED)
    pools = {stem: rng.sample(groups, min(PER_FILE, len(groups))) for stem, groups in sorted(kept.items())}
    chosen: list = []
    for rnd in range(PER_FILE):
        for stem in rng.sample(sorted(pools), len(pools)):
            if rnd < len(pools[stem]) and len(chosen) < CAP:
                chosen.append(pools[stem][rnd])
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tests", type=Path, help="the suite's tests/ folder (draft2020-12/, draft2019-09/, ...)")
    parser.add_argument("out", type=Path, help="the data folder to write")
    args = parser.parse_args()
    kept = eligible(args.tests)
    chosen = sample(kept)
    picked = {(d, s, i) for d, s, i, _ in chosen}
    rest = [g for stem in sorted(kept) for g in kept[stem] if g[:3] not in picked]
    index = []
    for subset, groups in (("synth", chosen), ("synth_extra", rest)):
        os.makedirs(args.out / subset, exist_ok=True)
        for draft, stem, i, group in groups:
            name = f"{subset}/{draft.replace('draft', 'd')}_{stem}_{i}.json"
            doc = {
                "description": f"JSON-Schema-Test-Suite {draft}/{stem} #{i}: {group['description']}",
                "schema": group["schema"],
                "tests": [{k: t[k] for k in ("description", "valid", "data")} for t in group["tests"]],
            }
            (args.out / name).write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
            index.append({"file": name, "subset": subset})
    (args.out / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    print(f"{len(chosen)} schemas in synth, {len(rest)} in synth_extra: {args.out}")


if __name__ == "__main__":
    main()
