"""A real Prometheus server scrapes the service; the README's hit-ratio expression is exact."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.server_proc import ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="prometheus binary not installed (Debian package 'prometheus'; .ci/run installs it)",
)


def readme_expression(block: str = "hit-ratio") -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(rf"<!-- {block} -->\s*```promql\n(.*?)```", text, re.S)
    assert m, f"README.md lost its {block} expression block"
    return " ".join(m.group(1).split())


def query(prom: str, expr: str) -> list:
    r = httpx.get(prom + "/api/v1/query", params={"query": expr}, timeout=10)
    r.raise_for_status()
    return r.json()["data"]["result"]


def test_hit_ratio_through_prometheus(tmp_path):
    server = ServerProcess(
        "--context-length", "256", "--chunked-prefill-size", "256", "--prefill-buckets", "64",
        "--max-padding-fraction", "0.5", "--decode-graphs", "on", "--decode-graph-sizes", "1,2",
        log_path=tmp_path / "server.log",
    )  # fmt: skip
    port = free_port()
    prom = f"http://127.0.0.1:{port}"
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: capture-service\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{server.port}']\n"
    )
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--web.listen-address=127.0.0.1:{port}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prom.log", "w"),  # noqa: SIM115
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the first scrape (all counters at 0) landed
            try:
                up = query(prom, 'up{job="capture-service"}')
                if up and up[0]["value"][1] == "1":
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(
                "Prometheus never scraped the service:\n" + (tmp_path / "prom.log").read_text()
            )
        time.sleep(1.5)
        # 3 hits (40 tokens pad 24 of bucket 64) and 1 miss (10 tokens would pad 54 > 50%)
        for n in (40, 10, 40, 40):
            body = {"input_ids": [5] * n, "sampling_params": {"max_new_tokens": 1}}
            r = httpx.post(server.url + "/generate", json=body, timeout=60)
            assert r.status_code == 200, r.text
        expr = readme_expression()
        deadline = time.monotonic() + 30
        value = None
        while time.monotonic() < deadline:
            time.sleep(1.0)
            total = query(prom, "sum(capture_service_prefill_batches_total)")
            if total and float(total[0]["value"][1]) == 4.0:
                time.sleep(2.5)  # two more scrapes inside the window
                (sample,) = query(prom, expr)
                value = float(sample["value"][1])
                break
        assert value == pytest.approx(0.75, abs=1e-9)
        # decode: three requests together (2 steps above the largest size 2: misses), then one
        # alone (2 steps of size 1: hits)
        for ids in ([[7, 8], [9, 10], [11, 12]], [13, 14]):
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
            assert httpx.post(server.url + "/generate", json=body, timeout=60).status_code == 200
        deadline = time.monotonic() + 30
        decode = None
        while time.monotonic() < deadline:
            steps = query(prom, "sum(capture_service_decode_steps_total)")
            if steps and float(steps[0]["value"][1]) == 4.0:
                time.sleep(2.5)
                (sample,) = query(prom, readme_expression("decode-hit-ratio"))
                decode = float(sample["value"][1])
                break
            time.sleep(1.0)
        assert decode == pytest.approx(0.5, abs=1e-9)
        miss = query(prom, 'capture_service_prefill_batches_total{result="miss",'
                           'reason="padding_over_limit"}')  # fmt: skip
        # the 10-token prefill, then the decode requests' prefills (6 and 2 tokens: over 50%)
        assert float(miss[0]["value"][1]) == 3.0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        server.stop()
