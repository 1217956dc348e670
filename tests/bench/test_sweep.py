"""--goodput, --burstiness, the shared-prefix workloads and --sweep (the highest rate meeting the SLO)."""
from __future__ import annotations

import asyncio
import math
import random

import pytest

from pagedserve.bench.dataset import WORDS, load_dataset
from pagedserve.bench.metrics import SLO
from pagedserve.bench.sweep import find_max_rate
from pagedserve.cli import main
from tests.bench.conftest import bench, read_report
from tests.bench.test_fake_server import gaps_slept


def search(capacity, start, steps=4, max_rate=None, stop_after=None):
    # A server that meets the SLO for every request up to `capacity` req/s and for half of them above.
    tried = []

    async def probe(rate):
        if stop_after is not None and len(tried) >= stop_after:
            return None
        tried.append(round(rate, 3))
        return 1.0 if rate <= capacity else 0.5

    found = asyncio.run(find_max_rate(probe, start, 0.9, steps, max_rate))
    return found and round(found, 3), tried


def test_doubling_then_bisection_finds_the_capacity():
    assert search(3.7, 1.0) == (3.668, [1.0, 2.0, 4.0, 2.828, 3.364, 3.668, 3.83])
    # Too high a start halves until a rate passes, then bisects the same way.
    assert search(3.7, 16.0, steps=2) == (3.364, [16.0, 8.0, 4.0, 2.0, 2.828, 3.364])
    # A cap ends the doubling; a stop (Ctrl-C) ends the search with what passed so far.
    assert search(100.0, 1.0, max_rate=5.0) == (5.0, [1.0, 2.0, 4.0, 5.0])
    assert search(3.7, 1.0, stop_after=2) == (2.0, [1.0, 2.0])
    assert search(0.0, 1.0, steps=0)[0] is None


def test_goodput_flag_is_vllms_milliseconds():
    assert SLO.parse_goodput(["ttft:3000", "tpot:360"]) == SLO(ttft_s=3.0, tpot_s=0.36)
    assert SLO.parse_goodput(["e2el:1500"]) == SLO(e2el_s=1.5)
    for bad in ("ttft", "itl:5", "tpot:x", "ttft:-3", "ttft:0"):
        with pytest.raises(ValueError, match="--goodput"):
            SLO.parse_goodput([bad])


def test_prefix_repetition_workload():
    reqs = load_dataset("prefix_repetition", 12, (3, 5), (2, 2), shared_prefix_len=6, seed=1, num_prefixes=3)
    assert reqs == load_dataset("prefix_repetition", 12, (3, 5), (2, 2), shared_prefix_len=6, seed=1,
                                num_prefixes=3)
    prefixes = [" ".join(r.prompt.split()[:6]) for r in reqs]
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [4, 4, 4]
    assert all(9 <= len(r.prompt.split()) == r.prompt_len <= 11 and set(r.prompt.split()) <= set(WORDS)
               for r in reqs)
    other = load_dataset("prefix_repetition", 12, (3, 5), (2, 2), shared_prefix_len=6, seed=1, num_prefixes=3,
                         variant=1)
    assert [" ".join(r.prompt.split()[:6]) for r in other] == prefixes  # same prefixes, fresh suffixes
    assert all(a.prompt != b.prompt for a, b in zip(reqs, other))


def test_generated_shared_prefix_workload_has_groups_and_turns():
    reqs = load_dataset("generated-shared-prefix", 12, (4, 4), (3, 3), shared_prefix_len=10, seed=2,
                        num_prefixes=2, num_turns=3)
    assert len(reqs) == 12
    first, second, third = reqs[:4], reqs[4:8], reqs[8:]
    assert len({" ".join(r.prompt.split()[:10]) for r in reqs}) == 2  # two groups' system prompts
    for t1, t2, t3 in zip(first, second, third):
        # Each turn resends the conversation: the earlier prompt, a 3-word answer, then the new question.
        assert t2.prompt.startswith(t1.prompt + " ") and t3.prompt.startswith(t2.prompt + " ")
        assert (t1.prompt_len, t2.prompt_len, t3.prompt_len) == (14, 21, 28) == \
            (len(t1.prompt.split()), len(t2.prompt.split()), len(t3.prompt.split()))


def test_unknown_dataset_names_the_shared_prefix_workloads():
    with pytest.raises(ValueError, match="prefix_repetition"):
        load_dataset("nope", 4, (1, 1), (1, 1))


def test_sweep_against_a_scripted_server(fake, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(bench("--base-url", fake.url, "--num-prompts", "3", "--input-len", "4", "--output-len", "2",
                    "--sweep", "--request-rate", "4", "--sweep-max-rate", "8", "--goodput", "ttft:2000",
                    "tpot:500", "--price-per-hour", "3.6", "--dataset", "prefix_repetition",
                    "--num-prefixes", "2", "--out", str(out)))
    assert rc == 0
    report = read_report(out)
    [sweep] = report["sweeps"]
    assert sweep["max_rate"] == 8 and [p["request_rate"] for p in sweep["probes"]] == [4, 8]
    best = sweep["probes"][1]["metrics"]
    assert best["slo_attainment"] == 1.0 and sweep["cost_per_million_output_tokens"] == pytest.approx(
        0.001 / best["good_output_throughput"] * 1e6)
    assert report["config"]["slo"] == {"ttft_s": 2.0, "tpot_s": 0.5, "e2el_s": None}
    assert len(report["runs"]) == 2
    prompts = [b["prompt"] for b in fake.bodies[-6:]]
    assert len({" ".join(p.split()[:256]) for p in prompts}) == 2 and len(set(prompts)) == 6
    text = capsys.readouterr().out
    assert "max rate      8.000 req/s" in text and "per 1M output tokens" in text


@pytest.mark.parametrize("flags, message", [
    (["--sweep"], "--sweep needs latency targets"),
    (["--sweep", "--goodput", "ttft:100", "--concurrency", "2"], "open-loop"),
    (["--goodput", "ttft:100", "--slo-ttft", "0.1"], "ttft given by both"),
    (["--goodput", "speed:3"], "--goodput takes"),
])
def test_bad_sweep_and_goodput_flags(fake, capsys, flags, message):
    assert main(bench("--base-url", fake.url, "--num-prompts", "2", *flags)) == 2
    assert message in capsys.readouterr().err


def test_bursty_arrivals_follow_the_seeded_gamma_gaps(fake, tmp_path, monkeypatch):
    out, gaps = tmp_path / "r.json", gaps_slept(monkeypatch)
    assert main(bench("--base-url", fake.url, "--num-prompts", "6", "--input-len", "4", "--output-len", "2",
                      "--request-rate", "10", "--burstiness", "0.5", "--seed", "3", "--out", str(out))) == 0
    m = read_report(out)["runs"][0]["metrics"]
    rng = random.Random(3)
    assert gaps == [rng.gammavariate(0.5, 1 / (10 * 0.5)) for _ in range(5)]
    assert not math.isclose(sum(gaps), sum(random.Random(3).expovariate(10) for _ in range(5)))
    assert sum(gaps) + 0.12 <= m["duration_s"]  # the last arrival, then its 0.12 s request
