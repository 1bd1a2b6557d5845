"""The compilers the kernels need at run time, and what ``auto`` does where one is missing.

A container on a CUDA runtime image imports FlashInfer and then fails at its first kernel (no
nvcc to build it, nothing prebuilt); a slim Python image imports triton and then fails at the
first Triton kernel (no C compiler for its launcher). These tests run each lookup over real
scripts on disk (working, broken, not executable) in the library's own order, and the choices
that follow from it.
"""

from __future__ import annotations

import logging
import shutil
import stat
from pathlib import Path

import pytest

from service.errors import ConfigError
from service.ranks import flashinfer_toolchain as tc
from service.ranks import triton_toolchain as tt
from service.ranks.select import (
    choose_attention,
    choose_gate_up,
    choose_kernels,
    choose_rope_store,
    choose_splitk_norm,
)
from service.ranks.startup import warn_by_name


def tool(path: Path, executable: bool = True, body: str = "echo 'Cuda compilation tools'") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(stat.S_IRWXU if executable else stat.S_IRUSR | stat.S_IWUSR)
    return path


def look(env: dict[str, str], prebuilt: bool = False, default: Path | None = None):
    """find() over ``env`` alone: PATH is the env's, and /usr/local/cuda is ``default``."""

    def which(name: str) -> str | None:
        return shutil.which(name, path=env.get("PATH", ""))

    def check(p: str) -> str | None:  # the service's own check, /usr/local/cuda moved
        if p.startswith(tc.DEFAULT_CUDA_HOME + "/"):
            if default is None:
                return "not found"
            p = str(default / p.removeprefix(tc.DEFAULT_CUDA_HOME + "/"))
        return tc.check_compiler(p)

    return tc.find(env, which, check, lambda m: prebuilt and m == tc.JIT_CACHE_MODULE)


def test_cuda_home_decides_before_the_path_as_flashinfer_does(tmp_path):
    home = tmp_path / "toolkit"
    nvcc = tool(home / "bin" / "nvcc")
    other = tool(tmp_path / "other" / "bin" / "nvcc")
    got = look({"CUDA_HOME": str(home), "PATH": str(other.parent)})
    assert got.nvcc == str(nvcc) and tc.blocker(got) is None
    # CUDA_PATH is the second name FlashInfer reads
    assert look({"CUDA_PATH": str(home)}).nvcc == str(nvcc)
    # a CUDA_HOME without a compiler is what FlashInfer would run: nothing, whatever PATH holds
    empty = tmp_path / "runtime-only"
    empty.mkdir()
    got = look({"CUDA_HOME": str(empty), "PATH": str(other.parent)})
    assert got.nvcc is None and got.looked_for == str(empty / "bin" / "nvcc")
    assert tc.blocker(got) is not None


def test_without_cuda_home_the_nvcc_on_the_path_names_the_toolkit(tmp_path):
    nvcc = tool(tmp_path / "cuda-12.8" / "bin" / "nvcc")
    assert look({"PATH": f"{tmp_path / 'nothing'}:{nvcc.parent}"}).nvcc == str(nvcc)


def test_without_either_it_looks_in_usr_local_cuda(tmp_path):
    got = look({"PATH": str(tmp_path)}, default=tmp_path / "absent")
    assert got.nvcc is None and got.looked_for == "/usr/local/cuda/bin/nvcc"
    tool(tmp_path / "present" / "bin" / "nvcc")
    got = look({"PATH": str(tmp_path)}, default=tmp_path / "present")
    assert got.nvcc == "/usr/local/cuda/bin/nvcc"


def test_a_file_that_cannot_run_is_no_compiler(tmp_path):
    home = tmp_path / "toolkit"
    tool(home / "bin" / "nvcc", executable=False)
    got = look({"CUDA_HOME": str(home)})
    assert got.nvcc is None and got.problem == "not executable"
    assert "not executable" in tc.blocker(got)


def test_a_wrapper_whose_toolkit_is_gone_is_no_compiler(tmp_path):
    """A `nvcc` that execs a toolkit that is not there (seen on a development VM) exits non-zero
    on --version: no compiler, and the reason carries what it printed."""
    home = tmp_path / "toolkit"
    tool(home / "bin" / "nvcc", body=f'exec {tmp_path}/cuda-13.0/bin/nvcc "$@"')
    got = look({"CUDA_HOME": str(home)})
    assert got.nvcc is None and got.problem.startswith("`--version` exited 127")
    assert "cuda-13.0/bin/nvcc" in got.problem


def test_flashinfer_nvcc_overrides_by_path_or_by_name(tmp_path):
    wrapper = tool(tmp_path / "wrap" / "my-nvcc")
    home = tmp_path / "toolkit"
    tool(home / "bin" / "nvcc")
    got = look({"FLASHINFER_NVCC": str(wrapper), "CUDA_HOME": str(home)})
    assert got.nvcc == str(wrapper)
    got = look({"FLASHINFER_NVCC": "my-nvcc", "PATH": str(wrapper.parent)})
    assert got.nvcc == str(wrapper)
    # an override that is not there blocks, even with a toolkit under CUDA_HOME: FlashInfer
    # would run the override
    got = look({"FLASHINFER_NVCC": str(tmp_path / "gone"), "CUDA_HOME": str(home)})
    assert got.nvcc is None and str(tmp_path / "gone") in tc.blocker(got)


def test_prebuilt_kernels_need_no_compiler(tmp_path):
    got = look({"PATH": str(tmp_path)}, prebuilt=True, default=tmp_path / "absent")
    assert got.nvcc is None and tc.blocker(got) is None
    assert "flashinfer-jit-cache" in tc.describe(got)


def test_the_lookup_with_its_own_defaults_reads_this_process(tmp_path, monkeypatch):
    nvcc = tool(tmp_path / "toolkit" / "bin" / "nvcc")
    monkeypatch.delenv("FLASHINFER_NVCC", raising=False)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "toolkit"))
    assert tc.find() == tc.KernelSource(prebuilt=tc.installed(tc.JIT_CACHE_MODULE),
                                        nvcc=str(nvcc), looked_for=str(nvcc))  # fmt: skip
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "elsewhere"))
    got = tc.find()
    assert got.nvcc is None and got.problem == "not found"
    assert tc.installed("json") and not tc.installed("no_such_module_anywhere")


NONE = tc.KernelSource(
    prebuilt=False, nvcc=None, looked_for="/usr/local/cuda/bin/nvcc", problem="not found"
)
NVCC = tc.KernelSource(prebuilt=False, nvcc="/opt/cuda/bin/nvcc", looked_for="/opt/cuda/bin/nvcc")


@pytest.mark.parametrize("choose", [choose_attention, choose_kernels])
def test_auto_serves_on_torch_where_flashinfer_cannot_get_its_kernels(choose):
    got = choose("auto", "cuda", "bfloat16", 128, None, source=NONE)
    assert got.name == "torch"
    # the reason says what to change
    assert "/usr/local/cuda/bin/nvcc" in got.reason and "flashinfer-jit-cache" in got.reason
    assert "CUDA toolkit" in got.reason
    # with a compiler it takes FlashInfer and says where the kernels come from
    got = choose("auto", "cuda", "bfloat16", 128, None, source=NVCC)
    assert got.name == "flashinfer" and "/opt/cuda/bin/nvcc" in got.reason
    # without a source (not asked: FlashInfer was no candidate) the choice is as before
    assert choose("auto", "cuda", "bfloat16", 128, None).name == "flashinfer"
    # the device, import and shape blockers still come first
    assert choose("auto", "cpu", "bfloat16", 128, None, source=NVCC).name == "torch"


@pytest.mark.parametrize("choose", [choose_attention, choose_kernels])
def test_by_name_flashinfer_is_taken_without_a_compiler_and_warned_about(choose, caplog):
    got = choose("flashinfer", "cuda", "bfloat16", 128, None, source=NONE)
    assert got.name == "flashinfer" and "only from FlashInfer's cache" in got.reason
    with caplog.at_level(logging.WARNING, logger="service.ranks.startup"):
        warn_by_name(got, tc.blocker(NONE))
    assert "asked for by name" in caplog.text and "flashinfer-jit-cache" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="service.ranks.startup"):
        warn_by_name(
            choose("flashinfer", "cuda", "bfloat16", 128, None, source=NVCC), tc.blocker(NVCC)
        )
        warn_by_name(choose("auto", "cuda", "bfloat16", 128, None, source=NONE), tc.blocker(NONE))
    assert caplog.text == ""  # a compiler, or torch chosen: nothing to warn about
    # what cannot run at all is still refused by name
    with pytest.raises(ConfigError, match="head dim"):
        choose("flashinfer", "cuda", "bfloat16", 32, None, source=NVCC)


def test_mla_keeps_its_note_and_gains_the_source():
    got = choose_attention("auto", "cuda", "bfloat16", 192, None, mla=(512, 64), source=NVCC)
    assert got.name == "flashinfer" and "MLA" in got.reason and "/opt/cuda/bin/nvcc" in got.reason
    got = choose_attention("auto", "cuda", "bfloat16", 192, None, mla=(512, 64), source=NONE)
    assert got.name == "torch"


# --- Triton: a C compiler (CC, else gcc, else clang) and Python.h


def headers(tmp_path: Path, present: bool = True) -> str:
    inc = tmp_path / "include"
    inc.mkdir(exist_ok=True)
    if present:
        (inc / "Python.h").write_text("")
    return str(inc)


def triton_look(tmp_path: Path, env: dict[str, str], python_h: bool = True) -> tt.LauncherBuild:
    return tt.find(env, lambda n: shutil.which(n, path=env.get("PATH", "")),
                   include=headers(tmp_path, python_h))  # fmt: skip


def test_triton_takes_cc_first_then_gcc_then_clang(tmp_path):
    bins = tmp_path / "bin"
    gcc, clang = tool(bins / "gcc"), tool(bins / "clang")
    mine = tool(tmp_path / "mine" / "cc-wrapper")
    got = triton_look(tmp_path, {"CC": str(mine), "PATH": str(bins)})
    assert got.cc == str(mine) and tt.blocker(got) is None
    assert triton_look(tmp_path, {"PATH": str(bins)}).cc == str(gcc)
    gcc.unlink()
    assert triton_look(tmp_path, {"PATH": str(bins)}).cc == str(clang)
    clang.unlink()
    got = triton_look(tmp_path, {"PATH": str(bins)})
    assert got.cc is None and "no C compiler" in tt.blocker(got)
    assert "build-essential" in tt.blocker(got) and "CC" in tt.blocker(got)


def test_triton_needs_a_compiler_that_runs_and_pythons_headers(tmp_path):
    bins = tmp_path / "bin"
    tool(bins / "gcc", body="exit 2")
    got = triton_look(tmp_path, {"PATH": str(bins)})
    assert "`--version` exited 2" in got.problem and str(bins / "gcc") in got.problem
    tool(bins / "gcc")
    assert tt.blocker(triton_look(tmp_path, {"PATH": str(bins)})) is None
    bare = tmp_path / "bare"
    bare.mkdir()
    got = triton_look(bare, {"PATH": str(bins)}, python_h=False)
    assert "Python.h" in got.problem and "python3-dev" in tt.blocker(got)


def test_triton_lookup_with_its_own_defaults_reads_this_process(tmp_path, monkeypatch):
    cc = tool(tmp_path / "bin" / "my-cc")
    monkeypatch.setenv("CC", str(cc))
    got = tt.find()
    assert got.cc == str(cc) and got.python_h.endswith("Python.h")
    # this machine runs the CPU tests, whose Triton kernels compile for real
    # (tests/test_triton_compiles.py): its Python has its headers
    assert got.problem is None


CANNOT_BUILD = tt.blocker(tt.LauncherBuild(cc=None, python_h="/x/Python.h",
                                           problem="no C compiler"))  # fmt: skip
SM90 = (9, 0)


def _rope_store(req: str, build_error: str | None):
    return choose_rope_store(req, "cuda", "bfloat16", 128, "flashinfer", None,
                             build_error=build_error)  # fmt: skip


@pytest.mark.parametrize(
    "choose",
    [
        lambda req, b: choose_gate_up(req, "cuda", "bfloat16", SM90, None, None, b),
        _rope_store,
        lambda req, b: choose_splitk_norm(req, "cuda", "bfloat16", SM90, 1, None, b),
    ],
    ids=["gate_up", "rope_store", "splitk_norm"],
)
def test_auto_keeps_the_torch_path_where_triton_cannot_build_launchers(choose, caplog):
    assert choose("auto", None).name == "triton"
    got = choose("auto", CANNOT_BUILD)
    assert got.name == "torch" and "no C compiler" in got.reason
    # by name it is taken, and the start-up log says why it may fail
    got = choose("triton", CANNOT_BUILD)
    assert got.name == "triton"
    with caplog.at_level(logging.WARNING, logger="service.ranks.startup"):
        warn_by_name(got, CANNOT_BUILD)
        warn_by_name(choose("auto", CANNOT_BUILD), CANNOT_BUILD)
        warn_by_name(choose("triton", None), None)
    assert caplog.text.count("asked for by name") == 1 and "no C compiler" in caplog.text


def test_split_k_needs_a_torch_whose_bmm_writes_float32():
    """The split-K partials come from ``torch.bmm(..., out_dtype=torch.float32)``; an older
    torch has no such overload and would fail at the first capture."""
    import torch

    from service.ranks.select import float32_bmm_error

    assert float32_bmm_error(torch.ops.aten.bmm.overloads(), torch.__version__) is None
    why = float32_bmm_error(["default", "out"], "2.4.1")
    assert why is not None and "2.4.1" in why and "upgrade torch" in why
    got = choose_splitk_norm("auto", "cuda", "bfloat16", SM90, 1, None, None, why)
    assert got.name == "torch" and "aten::bmm.dtype" in got.reason
    with pytest.raises(ConfigError, match="upgrade torch"):
        choose_splitk_norm("triton", "cuda", "bfloat16", SM90, 1, None, None, why)
    # off CUDA the CPU partials take the float path and need no such overload
    cpu = choose_splitk_norm("auto", "cpu", "float32", None, 1, None, None, why)
    assert "CUDA device" in cpu.reason
