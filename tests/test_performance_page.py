"""docs/performance.md is benchmarks/render_performance.py's render of benchmarks/results/*.json: it matches the
render, its figures move with the result files, every run in them says where it came from, and the page's prose
names no commit or date (those are in its provenance table)."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness  # noqa: E402
import render_performance  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "performance.md"


def all_runs():
    for path in sorted(RESULTS.glob("*.json")):
        for run in json.loads(path.read_text())["runs"]:
            yield path.name, run


def test_the_page_is_the_render_of_the_result_files():
    assert PAGE.read_text() == render_performance.render(RESULTS), (
        "docs/performance.md differs from its render: run python3 benchmarks/render_performance.py")


def test_the_page_fits_in_400_lines():
    assert PAGE.read_text().count("\n") <= 400


def test_a_figure_changed_in_a_result_file_changes_the_page(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    dense = results / "dense_h200.json"
    data = json.loads(dense.read_text())
    [baseline] = [r for r in data["runs"][0]["results"] if r["model"] == "hf-llama-sdpa"]
    assert "| 119.0 |" in render_performance.render(results)
    baseline["ms_per_step"] = 987.6
    dense.write_text(json.dumps(data))
    assert "| 987.6 |" in render_performance.render(results)


def test_every_run_records_command_commit_date_machine_and_versions():
    for name, run in all_runs():
        for field in ("command", "commit", "date", "machine"):
            assert isinstance(run.get(field), str) and run[field].strip(), f"{name}: no {field}"
        assert re.match(r"\d{4}-\d{2}-\d{2}", run["date"]), f"{name}: date {run['date']!r}"
        assert isinstance(run.get("versions"), dict), f"{name}: no versions"
        assert run["versions"] or run.get("provenance_note"), f"{name}: no versions and no note saying why"
        assert set(harness.PROVENANCE) <= set(run)


def test_the_prose_names_no_commit_and_no_date():
    page = PAGE.read_text()
    prose = page[:page.index("\n## Provenance\n")]
    commits = {run["commit"].split("+")[0] for _, run in all_runs()} | {
        run["against"]["commit"] for _, run in all_runs() if "against" in run}  # bench_conversion --against
    assert len(commits) > 5
    named = sorted(commit for commit in commits if re.search(rf"\b{re.escape(commit)}\b", prose))
    assert not named, f"commits in the prose of docs/performance.md: {named}"
    dates = re.findall(r"\b20\d\d-\d\d-\d\d\b", prose)
    assert not dates, f"dates in the prose of docs/performance.md: {dates}"
    assert "## Provenance" in page and all(f"`{path.name}`" in page for path in RESULTS.glob("*.json"))
