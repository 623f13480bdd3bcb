"""benchmarks/README.md's tables are what tools/gen_bench_tables.py writes from
benchmarks/results/*.json now: a result added, replaced or removed without regenerating them
fails here."""

from tools import gen_bench_tables
from tools.gen_bench_tables import README, load_results, render, rewritten


def test_the_benchmark_tables_are_current():
    readme = README.read_text()
    assert rewritten(readme, render(load_results())) == readme, (
        "stale tables in benchmarks/README.md: run python -m tools.gen_bench_tables"
    )
    assert gen_bench_tables.main(["--check"]) == 0


def test_every_result_file_has_a_table():
    # A kind the generator does not know is only listed by name; the kept results all have
    # their figures shown.
    region = render(load_results())
    assert "No table yet" not in region
    for name in load_results():
        assert f"`{name}`" in region, name
