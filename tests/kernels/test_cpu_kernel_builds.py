"""Which builds of the fused CPU kernels a host makes (runtime/kernels/cpu/cpu_kernels.py): the ISA paths it
tests, the cache key of each build, and what happens without a compiler or off x86-64."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from plait.runtime.kernels.cpu import cpu_kernels

ZEN4 = "fpu sse2 avx avx2 fma f16c bmi2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 avx512_vnni"
SAPPHIRE_RAPIDS = ZEN4 + " avx512_fp16 amx_bf16 amx_tile amx_int8"
ZEN3 = "fpu sse2 avx avx2 fma f16c bmi2 vaes"
AVX512_PLAIN = "fpu sse2 avx avx2 fma f16c avx512f avx512dq avx512cd avx512bw avx512vl"


@pytest.fixture
def host(monkeypatch):
    """A fake host: (machine, cpuinfo flags), with PLAIT_CPU_MARCH unset unless given."""

    def make(flags: str, machine: str = "x86_64", march: str | None = None):
        monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: machine)
        monkeypatch.setattr(cpu_kernels, "_cpu_features", lambda: flags)
        if march is None:
            monkeypatch.delenv("PLAIT_CPU_MARCH", raising=False)
        else:
            monkeypatch.setenv("PLAIT_CPU_MARCH", march)

    return make


@pytest.mark.parametrize(
    "flags,paths",
    [
        (ZEN4, ["native", "x86-64-v4", "x86-64-v3", "x86-64"]),  # BF16 + VNNI: native is its own path
        (SAPPHIRE_RAPIDS, ["native", "x86-64-v4", "x86-64-v3", "x86-64"]),
        (AVX512_PLAIN, ["native", "x86-64-v3", "x86-64"]),  # native takes v4's blocks
        (ZEN3, ["native", "x86-64"]),  # native takes v3's blocks
        ("fpu sse2", ["native"]),  # only the scalar code
    ],
)
def test_host_paths_are_each_isa_block_set_the_cpu_runs(host, flags, paths):
    host(flags)
    assert cpu_kernels.host_paths() == paths


def test_the_configured_path_comes_first_and_is_not_repeated(host):
    host(ZEN4, march="x86-64-v3")
    assert cpu_kernels.host_paths() == ["x86-64-v3", "native", "x86-64-v4", "x86-64"]
    host(ZEN3, march="x86-64")
    assert cpu_kernels.host_paths() == ["x86-64", "native"]


def test_other_architectures_build_only_the_configured_path_and_only_when_asked(host, monkeypatch):
    host("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics", machine="aarch64")
    assert cpu_kernels.host_paths() == ["native"]
    monkeypatch.delenv("PLAIT_CPU_KERNELS", raising=False)
    wanted, why = cpu_kernels._wanted()
    assert not wanted and "aarch64" in why
    monkeypatch.setenv("PLAIT_CPU_KERNELS", "1")
    assert cpu_kernels._wanted() == (True, "")


def test_the_build_name_keys_on_march_features_and_sources(host, monkeypatch, tmp_path):
    host(ZEN4)
    native, ns, flags = cpu_kernels.build_spec("native")
    assert ns == "plait_cpu_native" and "-march=native" in flags and f"-DPLAIT_NS={ns}" in flags
    v3 = cpu_kernels.build_spec("x86-64-v3")
    assert v3[1] == "plait_cpu_x86_64_v3" and v3[0] != native
    host(SAPPHIRE_RAPIDS)  # another CPU: another native build, the same portable ones
    assert cpu_kernels.build_spec("native")[0] != native
    assert cpu_kernels.build_spec("x86-64-v3")[0] == v3[0]
    host("Features: fp asimd", machine="aarch64")  # ARM's feature line keys native builds too
    assert cpu_kernels.build_spec("native")[0] not in (native, v3[0])
    for f in cpu_kernels._CSRC.iterdir():  # a changed source (a header included) renames it
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "simd.h").write_bytes((tmp_path / "simd.h").read_bytes() + b"\n")
    host(ZEN4)
    monkeypatch.setattr(cpu_kernels, "_CSRC", tmp_path)
    assert cpu_kernels.build_spec("native")[0] != native


def test_no_compiler_means_no_kernels_and_the_eager_ops(tmp_path):
    """CXX names no compiler: load() is False with the reason, nothing raises, the model's ops run
    eagerly (a norm through its fallback)."""
    code = (
        "import torch; from plait.runtime.kernels.cpu import cpu_kernels as c\n"
        "assert c.load() is False\n"
        "err = c.build_error()\n"
        "assert isinstance(err, c.Unavailable) and 'no C++ compiler' in str(err), err\n"
        "x = torch.randn(2, 8); w = torch.ones(8)\n"
        "torch.testing.assert_close(c.rms_norm(x, w, 1e-5), torch.nn.functional.rms_norm(x, (8,), w, 1e-5))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PLAIT_CPU_KERNELS"}
    env["CXX"] = str(tmp_path / "no-such-compiler")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_disabled_by_environment():
    """PLAIT_CPU_KERNELS=0: no build is loaded (once, not per kernel path)."""
    code = "from plait.runtime.kernels.cpu import cpu_kernels as c; import sys; sys.exit(0 if c.load() is False else 1)"
    env = dict(os.environ, PLAIT_CPU_KERNELS="0")
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=120).returncode == 0
