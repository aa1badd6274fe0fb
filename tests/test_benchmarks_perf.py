"""Smoke tests of `plait bench roofline / quality / compare` on a tiny model at tiny sizes, so that
they keep running; plus the roofline's parameter count against the model itself."""

from __future__ import annotations

import json
import math

import pytest
import torch


def test_roofline_counts_the_linear_weights(tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    from plait.benchmarks.roofline import model_costs
    from plait.runtime.model_executor.model_loader import load_config

    for arch in ("llama", "qwen2"):  # tied and untied LM head
        path = tiny_model_dirs[arch]
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        linear = sum(m.weight.numel() for m in hf.modules() if isinstance(m, torch.nn.Linear))
        config = load_config(path)
        fp32, int8 = model_costs(config, "float32"), model_costs(config, "int8")
        assert fp32["linear_params"] == linear
        assert fp32["bytes_per_token"] == 4 * linear and fp32["flops_per_token"] == 2 * linear
        assert linear < int8["bytes_per_token"] < 1.1 * linear  # one byte a weight plus row scales


def test_roofline_quick(tiny_model_dirs, capsys):
    from plait.benchmarks.roofline import main

    r = main(["--model", tiny_model_dirs["llama"], "--quick", "--threads", "1", "--quantization", "int8"])
    assert r["kind"] == "int8" and r["machine"]["read_gbs"] > 0
    assert r["machine"]["read_gbs"] == max(v for k, v in r["machine"].items() if k.startswith("read_gbs_"))
    assert all(v > 0 for row in r["machine"]["matmul_gflops"].values() for v in row.values())
    assert r["batch1_tok_s"] == pytest.approx(r["machine"]["read_gbs"] * 1e9 / r["bytes_per_token"])
    assert r["large_batch_tok_s"] == pytest.approx(r["peak_gflops"] * 1e9 / r["flops_per_token"])
    assert "batch-1 decode ceiling" in capsys.readouterr().out


def test_remeasure_keeps_the_better_of_two(monkeypatch):
    from plait.benchmarks import roofline as rl

    reads, flops = iter([30.0, 20.0]), iter([5.0] * 8 + [7.0] * 8)
    monkeypatch.setattr(rl, "_cache", {})
    monkeypatch.setattr(rl, "measure_bandwidth", lambda size, reps: {"read_gbs": next(reads), "copy_gbs": 1.0})
    monkeypatch.setattr(rl, "measure_matmul", lambda kind, m, n, k, reps: next(flops))
    first = dict(rl.measure_machine(1, quick=True))
    assert first["read_gbs"] == 30.0 and first["matmul_gflops"]["float32"][1] == 5.0
    again = rl.remeasure_machine(1, quick=True)  # a slower bandwidth, faster matmuls: the better of each
    assert again["read_gbs"] == 30.0 and all(v == 7.0 for row in again["matmul_gflops"].values() for v in row.values())
    assert rl.measure_machine(1, quick=True) is again  # cached for the roofline() calls that follow


def test_kv_bytes_per_step_is_the_pools_slot_size(tiny_model_dirs):
    from plait.benchmarks.roofline import kv_bytes_per_step
    from plait.runtime.mem_cache.memory_pool import KVPool
    from plait.runtime.model_executor.model_loader import load_config

    config = load_config(tiny_model_dirs["qwen3"])  # head_dim apart from hidden / heads
    per_slot = KVPool.bytes_per_slot(
        config.num_hidden_layers, config.num_key_value_heads, config.head_dim, torch.bfloat16
    )
    assert kv_bytes_per_step(config, 100, 2) == 100 * per_slot


def test_step_profile_prints_fractions(tiny_model_dirs, capsys):
    from plait.benchmarks.step_profile import main

    res = main(
        [
            "--model",
            tiny_model_dirs["llama"],
            "--dtype",
            "float32",
            "--batch",
            "1",
            "2",
            "--prompt-len",
            "16",
            "--steps",
            "2",
            "--threads",
            "1",
            "--quick",
        ]
    )
    assert set(res) == {"mirror/1", "mirror/2"} and all(r["step_ms"] > 0 for r in res.values())
    out = capsys.readouterr().out
    assert "batch 1:" in out and "with the 17-token KV cache" in out and "batch 2:" in out and "roofline" in out
    # batch 1 in rounds (at most one a step), the bandwidth read around each; larger batches not
    assert len(res["mirror/1"]["paired"]) == 2 and "paired" not in res["mirror/2"]
    assert all(ms > 0 and gbs > 0 for ms, gbs in res["mirror/1"]["paired"]) and "paired: " in out


def test_paired_fractions_take_each_rounds_own_bandwidth():
    from plait.benchmarks.step_profile import paired_line

    # 100 MB a token: 10 ms at 20 GB/s and 40 ms at 5 GB/s are both half the bandwidth of their
    # round; against the best bandwidth (20 GB/s) the slow round would read as an eighth
    line = paired_line([(10.0, 20.0), (40.0, 5.0), (10.0, 10.0)], 100_000_000, 100_000_000)
    assert line.startswith("paired: 50% (50%-100%)") and "5.0-20.0 GB/s" in line and "100% with the KV cache" in line


def test_step_profile_breaks_the_fused_op_down(tiny_model_dirs, capsys):
    from plait.benchmarks.step_profile import main
    from plait.runtime.kernels.cpu import cpu_kernels

    res = main(
        [
            "--model",
            tiny_model_dirs["llama"],
            "--dtype",
            "float32",
            "--batch",
            "1",
            "--prompt-len",
            "16",
            "--steps",
            "3",
            "--threads",
            "1",
            "--skip-roofline",
            "--breakdown",
        ]
    )
    out = capsys.readouterr().out
    if not cpu_kernels.small_gemm_available(torch.float32):  # no fused op here: it says so
        assert "no step ran the fused decode op" in out
        return
    r = res["mirror/1"]
    assert r["fused_steps"] == 3  # every timed step took the fused op
    assert set(r["parts_ms"]) == set(cpu_kernels.DECODE_PARTS) and all(v >= 0 for v in r["parts_ms"].values())
    assert 0 < sum(r["parts_ms"].values()) <= r["forward_ms"]  # the layers are part of the forward
    from plait.runtime.model_executor.model_loader import load_config

    c = load_config(tiny_model_dirs["llama"])
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    qkv_out = (c.num_attention_heads + 2 * c.num_key_value_heads) * head_dim
    for name, n, k in (("qkv", qkv_out, c.hidden_size), ("down", c.hidden_size, c.intermediate_size)):
        padded = -(-n // 32) * 32  # small_gemm's panels of 32 outputs, float32
        assert r["projection_bytes"][name] == c.num_hidden_layers * padded * k * 4, name
    assert "GB/s" in out and "attention" in out


def test_quality_tiny(tiny_model_dirs, tmp_path):
    from plait.benchmarks.quality import main

    out = tmp_path / "q.json"
    res = main(
        [
            "--model",
            tiny_model_dirs["llama"],
            "--configs",
            "int8",
            "--num-prompts",
            "2",
            "--gen-len",
            "4",
            "--threads",
            "1",
            "--json",
            str(out),
        ]
    )
    assert set(res) == {"float32", "int8"}
    assert res["float32"]["greedy_token_agreement"] == 1.0
    for key in ("greedy_prefix_agreement", "greedy_token_agreement", "teacher_forced_agreement"):
        assert 0.0 <= res["int8"][key] <= 1.0
    assert math.isfinite(res["int8"]["perplexity"]) and res["int8"]["perplexity"] > 1
    assert json.loads(out.read_text())["results"]["int8"]["perplexity"] == res["int8"]["perplexity"]


def test_quality_configs_name_activations_and_weights():
    from plait.benchmarks.quality import parse_config

    assert parse_config("bfloat16") == {"dtype": "bfloat16"}
    assert parse_config("int4") == {"dtype": "float32", "quantization": "int4"}
    assert parse_config("bfloat16+int4") == {"dtype": "bfloat16", "quantization": "int4"}
    assert parse_config("float32/kv-bfloat16") == {"dtype": "float32", "kv_cache_dtype": "bfloat16"}
    assert parse_config("int8/kv-bfloat16") == {
        "dtype": "float32",
        "quantization": "int8",
        "kv_cache_dtype": "bfloat16",
    }
    for bad in ("int3", "bfloat16+float32", "fp16+int8", "bfloat16+", "float32/kv-int8", "float32/kv-"):
        with pytest.raises(ValueError, match="unknown configuration"):
            parse_config(bad)


def test_compare_tiny(tiny_model_dirs, tmp_path, capsys):
    from plait.benchmarks.compare import main

    out, png = tmp_path / "c.json", tmp_path / "c.png"
    res = main(
        [
            "--model",
            tiny_model_dirs["llama"],
            "--concurrency",
            "1",
            "2",
            "--output-len",
            "4",
            "--hf-sequential",
            "1",
            "--threads",
            "1",
            "--skip-roofline",
            "--json",
            str(out),
            "--plot",
            str(png),
            "--json-max-tokens",
            "12",
            "--num-programs",
            "4",
            "--num-shots",
            "1",
            "--program-max-tokens",
            "3",
            "--program-concurrency",
            "2",
        ]
    )
    assert set(res["results"]) == {"plait", "hf_static", "hf_sequential"}
    # JSON extraction: every plait output is constrained (a cut one may not parse), tok/s measured
    assert set(res["json"]) == {"plait"} and set(res["json"]["plait"]) == {1, 2}
    assert all(r["tok_s"] > 0 and r["requests"] == 8 for r in res["json"]["plait"].values())
    # programs: four kinds, their calls recorded and replayed
    prog = res["programs"]
    assert prog["programs"] == 4 and prog["calls"] >= 4 + 4 + 1 and prog["replay_s"]["plait"] > 0
    assert all(set(row) == {1, 2} and min(row.values()) > 0 for row in res["results"].values())
    assert any(n.startswith("llama.cpp: no GGUF") for n in res["notes"])  # a HF folder has no GGUF
    printed = capsys.readouterr().out
    assert "plait / hf_static" in printed and "json extraction" in printed and "replay on plait" in printed
    assert set(json.loads(out.read_text())["results"]) == set(res["results"])
    try:
        import matplotlib  # noqa: F401

        assert png.stat().st_size > 0
    except ImportError:
        assert "plot skipped" in printed


def test_llama_cpp_command_when_absent(monkeypatch):
    from plait.benchmarks import compare

    monkeypatch.setattr(compare.shutil, "which", lambda name: None)
    monkeypatch.setitem(__import__("sys").modules, "llama_cpp.server", None)  # import fails
    assert compare.llama_cpp_command("m.gguf", 1, 1, 1, 64) is None
    monkeypatch.setattr(compare.shutil, "which", lambda name: "/opt/llama-server")
    cmd = compare.llama_cpp_command("m.gguf", 1234, 2, 32, 512)
    assert cmd[0] == "/opt/llama-server" and cmd[cmd.index("-np") + 1] == "32" and cmd[cmd.index("-c") + 1] == "16384"


def test_llama_cpp_replay_of_a_recorded_call():
    """A recorded native call keeps its prompt, budget, stop strings and schema for llama.cpp."""
    from plait.benchmarks.compare import _llama_call

    schema = {"type": "object"}
    prompt, n, extra = _llama_call(
        {
            "text": "Q:",
            "sampling_params": {"max_new_tokens": 7, "stop": "\n", "json_schema": json.dumps(schema), "temperature": 0},
        }
    )
    assert (prompt, n) == ("Q:", 7)
    assert extra["stop"] == ["\n"] and extra["json_schema"] == schema and extra["cache_prompt"] is True
    assert _llama_call({"text": "x", "sampling_params": {"max_new_tokens": 3}})[2].get("json_schema") is None


# A stand-in for llama.cpp's `llama-server`: its CLI, /v1/models and /v1/completions (usage counts
# and text), logging every request body; JSON-schema requests get a record of the
# jump_forward benchmark's schema.
_FAKE_LLAMA_SERVER = r'''#!{python}
import json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port = int(sys.argv[sys.argv.index("--port") + 1])
log = open({log!r}, "a")
log.write(json.dumps({{"env": {{k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}}}}) + "\n")
RECORD = {{"full_name": "A B", "job_title": "dev", "employer_company_name": "C", "city_of_residence": "D",
          "years_of_professional_experience": 3, "current_employment_status": "retired",
          "primary_programming_language": "go", "is_open_to_new_opportunities": True}}

class Handler(BaseHTTPRequestHandler):
    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({{"data": []}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        log.write(json.dumps(body) + "\n")
        log.flush()
        text = json.dumps(RECORD) if "json_schema" in body else "x" * body["max_tokens"]
        self._send({{"choices": [{{"text": text}}], "usage": {{"completion_tokens": body["max_tokens"]}}}})

    def log_message(self, *args):
        pass

ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def test_compare_drives_llama_server(tiny_model_dirs, tmp_path, monkeypatch):
    """With a `llama-server` on PATH, every workload runs on it too: chat at each concurrency, JSON
    extraction with the schema sent and the outputs validated, the programs' recorded calls replayed
    with their stop strings and the prompt cache on."""
    import sys

    from conftest import free_port

    from plait.benchmarks import compare

    log = tmp_path / "requests.jsonl"
    server = tmp_path / "bin" / "llama-server"
    server.parent.mkdir()
    server.write_text(_FAKE_LLAMA_SERVER.format(python=sys.executable, log=str(log)))
    server.chmod(0o755)
    monkeypatch.setenv("PATH", f"{server.parent}:{__import__('os').environ['PATH']}")
    monkeypatch.setattr(compare, "gguf_for", lambda model: str(tmp_path / "model.gguf"))
    res = compare.main(
        [
            "--model",
            tiny_model_dirs["llama"],
            "--concurrency",
            "1",
            "2",
            "--output-len",
            "4",
            "--hf-sequential",
            "1",
            "--threads",
            "1",
            "--skip-roofline",
            "--llama-port",
            str(free_port()),
            "--json-max-tokens",
            "12",
            "--num-programs",
            "4",
            "--num-shots",
            "1",
            "--program-max-tokens",
            "3",
            "--program-concurrency",
            "2",
        ]
    )
    assert any(n.startswith("llama.cpp: " + str(server)) for n in res["notes"])
    assert set(res["results"]["llama.cpp"]) == {1, 2} and min(res["results"]["llama.cpp"].values()) > 0
    assert all(r["valid"] == r["requests"] == 8 for r in res["json"]["llama.cpp"].values())
    assert res["programs"]["replay_s"]["llama.cpp"] > 0
    bodies = [json.loads(line) for line in log.read_text().splitlines()]
    # llama.cpp runs with OpenMP's defaults, not the PASSIVE / spin-count settings plait's processes get
    assert [b["env"] for b in bodies if "env" in b] == [{}]
    bodies = [b for b in bodies if "env" not in b]
    schema_bodies = [b for b in bodies if "json_schema" in b]
    assert len(schema_bodies) == 16 + 1  # 8 per JSON level, and the programs' json_extraction call
    replayed = [b for b in bodies if b.get("cache_prompt")]
    assert len(replayed) == res["programs"]["calls"] and any(b.get("stop") == ["\n"] for b in replayed)


def test_structured_classifies_answers():
    from plait.benchmarks.structured import classify, summarize

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}

    def ok(text, reason="stop"):
        return {"choices": [{"finish_reason": reason, "message": {"content": text}}], "usage": {"completion_tokens": 5}}

    assert classify(schema, 200, ok('{"n": 1}'))[0] == "valid"
    assert classify(schema, 200, ok('{"n": "x"}'))[:2] == ("invalid", 5)  # returned as fine: the failure
    assert classify(schema, 200, ok('{"n": 1', "length"))[0] == "truncated"
    assert classify(schema, 400, {"error": {"message": "invalid grammar: x"}})[0] == "rejected"
    assert classify(schema, 500, {"error": {"message": "invalid output: ..."}})[0] == "withheld"
    rows = [{"source": "corpus", "outcome": o, "tokens": 5} for o in ("valid", "valid", "truncated", "rejected")]
    s = summarize(rows)["all"]
    assert (s["valid"], s["truncated"], s["rejected"], s["valid_of_accepted"]) == (2, 1, 1, round(2 / 3, 4))


def test_structured_through_a_server(tiny_model_dirs, tmp_path, capsys):
    from plait.benchmarks.structured import main

    out = tmp_path / "s.json"
    assert (
        main(
            [
                "--model",
                tiny_model_dirs["llama"],
                "--subset",
                "corpus",
                "--limit",
                "3",
                "--max-tokens",
                "24",
                "--concurrency",
                "3",
                "--throughput-requests",
                "4",
                "--throughput-rounds",
                "3",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())["results"][0]
    assert res["summary"]["all"]["schemas"] == 3 and res["summary"]["all"]["invalid"] == 0
    assert [t["concurrency"] for t in res["throughput"]] == [1, 32]
    assert all(len(t["ratios"]) == 3 and t["ratio"] == sorted(t["ratios"])[1] for t in res["throughput"])
    assert "backend auto" in capsys.readouterr().out
