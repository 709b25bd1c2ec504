"""Native CPU kernel for InfLLM v2 block-sparse (and dense) attention over a KV-major cache, as XLA FFI custom
calls: decode steps, and the non-forced picks of stage 2 in prefill and training forwards.

On XLA:CPU the references (:func:`~minicpm4_jax.ops.decode_ref.sparse_decode_attention`,
:func:`~minicpm4_jax.ops.infllm_ref.infllmv2_stage2`) have to gather copies of the selected blocks before
their products, and the products over those copies ran at a third of the bandwidth of the dense path
(``docs/benchmarks.md``). ``infllm_cpu.cc`` reads the selected blocks in place with an fp32 online softmax
(vectorised over the heads of a GQA group), one (sequence, KV head, token) per task on XLA's intra-op thread
pool, and can return each head's logsumexp for merging with another part of the attention
(:func:`decode_attention` ``return_lse``; :func:`minicpm4_jax.infllm.attention.native_stage2`). Same block
set and masking as the references (spec ``minicpm4_model.md`` §5.5, §5.7).

The source is compiled at first use with the system C++ compiler (``$CXX``, else ``g++``; ``-O3
-march=native``) into ``$MINICPM4_JAX_CACHE/native`` (default ``~/.cache/minicpm4_jax/native``), keyed by
the source, the compiler, the flags, the XLA FFI headers of the installed jaxlib and the CPU. Without a
compiler, on a non-CPU backend, or with ``MINICPM4_JAX_NATIVE=0`` :func:`available` is ``False`` and the
engine keeps the XLA references (:func:`minicpm4_jax.ops.dispatch.native_decode`).

Threads: a call that reads enough of the cache runs its items on the caller and on XLA's intra-op pool. The pool
thread that helped a call then lingers for ``MINICPM4_JAX_NATIVE_LINGER_US`` microseconds (default 1000; ``0``
= never), yielding its core to any other runnable thread, and takes the items of the next call posted meanwhile:
a batch-1 decode step calls the kernel once per layer every 0.2-0.5 ms, and waking a parked pool thread took
~0.1 ms on the development VMs (the same idea as OpenMP runtimes' spin-wait, e.g. ``KMP_BLOCKTIME``). At most
one helper lingers per process. Outputs do not depend on the setting (each item is computed by one thread).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from minicpm4_jax.ops.decode_ref import decode_shapes

__all__ = ["available", "build_error", "decode_attention", "dense_decode_attention", "library_path",
           "select_decode_attention", "supports_selection"]

_SOURCE = Path(__file__).with_name("infllm_cpu.cc")
_TARGET = "minicpm4_infllm_decode_f32"
_SELECT_TARGET = "minicpm4_infllm_select_decode_f32"
_LSE_TARGET = "minicpm4_infllm_attention_lse_f32"
# 512-bit vectors where the CPU has them (GCC's default for -march=native on x86 stops at 256)
_X86_FLAGS = ["-mprefer-vector-width=512"] if platform.machine().lower() in ("x86_64", "amd64") else []
_FLAGS = ["-O3", "-march=native", *_X86_FLAGS, "-fopenmp-simd", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC", "-w"]
_lock = threading.Lock()
_state: dict = {}


def _cpu_id() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cxx() -> list[str]:
    return shlex.split(os.environ.get("CXX") or "g++") or ["g++"]


def library_path() -> Path:
    """Where the compiled kernel for this source, compiler, jaxlib and CPU lives (built or not)."""
    cxx = _cxx()
    try:
        version = subprocess.run([*cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = "missing"
    key = hashlib.sha256("\0".join([_SOURCE.read_text(), " ".join(cxx), version, " ".join(_FLAGS),
                                    jax.ffi.include_dir(), jax.__version__, _cpu_id()]).encode()).hexdigest()[:20]
    from minicpm4_jax.compilation_cache import cache_root

    return cache_root() / "native" / f"infllm_cpu_{key}.so"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _atomic_write(path: Path, data: bytes, mode: int) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build(path: Path) -> None:
    """Compile into a temporary file, then publish its SHA-256 (``.sha256``) and the library, each by an atomic
    rename: a reader never sees a partial library, and :func:`_intact` rejects one damaged later."""
    cxx = _cxx()
    if shutil.which(cxx[0]) is None:
        raise RuntimeError(f"no C++ compiler {cxx[0]!r} on PATH (set CXX)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        cmd = [*cxx, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if res.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o755)  # loadable by every user of a shared cache directory
        _atomic_write(path.with_suffix(".sha256"), _digest(Path(tmp)).encode(), 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _prune(current: Path, keep: int = 8) -> list[Path]:
    """Delete the oldest compiled kernels (``infllm_cpu_*.so`` and their ``.sha256``) in ``current``'s directory,
    keeping ``current`` and the ``keep - 1`` others most recently built or loaded; returns the libraries removed.

    Every edit of the source, compiler or jaxlib builds a new library under a new name, so without this the cache
    only grows. Best effort: a file another process removes first, or a read-only cache, is left as it is (a
    process that has a removed library loaded keeps its mapping).
    """
    def mtime(p: Path) -> float:
        try:
            return p.stat().st_mtime
        except OSError:
            return float("inf")  # vanished meanwhile: nothing to remove

    others = sorted((p for p in current.parent.glob("infllm_cpu_*.so") if p.name != current.name), key=mtime,
                    reverse=True)
    removed = []
    for lib in others[max(0, keep - 1):]:
        try:
            lib.unlink()
            lib.with_suffix(".sha256").unlink(missing_ok=True)
            removed.append(lib)
        except OSError:
            pass
    return removed


def _intact(path: Path) -> bool:
    """The library exists and matches the digest written when it was built (a truncated file would crash the
    process in ``dlopen`` with SIGBUS instead of raising)."""
    sha = path.with_suffix(".sha256")
    try:
        return path.exists() and sha.read_text().strip() == _digest(path)
    except OSError:
        return False


_LINGER_MAX_US = 1_000_000


def check_settings() -> None:
    """Refuse a ``MINICPM4_JAX_NATIVE_LINGER_US`` the kernel could not use (it reads the value with ``atoll``).

    Called by :func:`available` and, so that a bad value stops a command before it prints anything, at the start
    of the ``minicpm4`` and ``minicpm4-lm-eval`` commands.

    Raises:
        ConfigError: the value is not a whole number of microseconds from 0 to 1000000.
    """
    raw = os.environ.get("MINICPM4_JAX_NATIVE_LINGER_US")
    if raw is None or raw.strip() == "":
        return
    value = raw.strip()
    if not value.isdigit() or int(value) > _LINGER_MAX_US:
        from minicpm4_jax.config import ConfigError  # noqa: PLC0415 (ops imports no config at module level)

        raise ConfigError(f"MINICPM4_JAX_NATIVE_LINGER_US={raw!r} must be a whole number of microseconds from 0 (no "
                          f"lingering pool thread) to {_LINGER_MAX_US}; unset it for the default 1000")


def _load() -> bool:
    check_settings()
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        _state["ok"], _state["error"] = False, None
        if os.environ.get("MINICPM4_JAX_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
            _state["error"] = f"disabled by MINICPM4_JAX_NATIVE={os.environ['MINICPM4_JAX_NATIVE']}"
            return False
        try:
            path = library_path()
            if not _intact(path):  # missing, or damaged since it was built: (re)build it
                _build(path)
                _prune(path)
            else:
                try:  # mark it recently used, so _prune keeps it
                    os.utime(path)
                except OSError:
                    pass
            lib = ctypes.cdll.LoadLibrary(str(path))
            jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.Minicpm4InfllmDecodeF32), platform="cpu")
            jax.ffi.register_ffi_target(_SELECT_TARGET, jax.ffi.pycapsule(lib.Minicpm4InfllmSelectDecodeF32),
                                        platform="cpu")
            jax.ffi.register_ffi_target(_LSE_TARGET, jax.ffi.pycapsule(lib.Minicpm4InfllmAttentionLseF32),
                                        platform="cpu")
            _state["lib"] = lib  # keep the library loaded
            _state["ok"] = True
        except Exception as e:  # noqa: BLE001 (any build or load failure means: use the XLA reference)
            _state["error"] = f"{type(e).__name__}: {e}"
        return _state["ok"]


def available() -> bool:
    """Whether the native decode kernel is built and registered (builds it on the first call, ~5 s).

    Raises:
        ConfigError: ``MINICPM4_JAX_NATIVE_LINGER_US`` set to anything but a whole number from 0 to 1000000.
    """
    return _load()


def build_error() -> str | None:
    """Why :func:`available` is ``False`` (``None`` when it is ``True`` or was not asked yet)."""
    return _state.get("error")


def _static_scale(scale, d: int) -> np.float32:
    if scale is None:
        return np.float32(d**-0.5)
    if not np.isscalar(scale):
        raise ValueError(f"scale={scale!r} must be a Python number (a static kernel attribute), not an array")
    return np.float32(scale)


def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, topk_idx: jax.Array, *,
                     q_positions: jax.Array, block_size: int, window_blocks: int = 0, init_blocks: int = 0,
                     gather_width: int | None = None, scale: float | None = None, return_lse: bool = False,
                     _window_keys: int = 0) -> jax.Array | tuple[jax.Array, jax.Array]:
    """:func:`~minicpm4_jax.ops.decode_ref.sparse_decode_attention` by the native CPU kernel (same arguments
    and result; float32 only).

    Args:
        q: float32 ``[batch, num_heads, head_dim]`` or ``[batch, T, num_heads, head_dim]``, post-RoPE.
        k_cache, v_cache: float32 ``[batch, num_kv_heads, capacity, head_dim]``; ``capacity`` a multiple of
            ``block_size``.
        topk_idx: int ``[batch, num_kv_heads, K]`` (or ``[batch, num_kv_heads, T, K]``) raw picks, ``-1``
            unused (so is any id outside ``[0, capacity / block_size)``); forced blocks may appear.
        q_positions: int ``[batch]`` (or ``[batch, T]``); ``-1`` = inactive row (zeros out).
        block_size, window_blocks, init_blocks, gather_width, scale: as the reference.
        return_lse: also return each head's logsumexp over its attended keys (``-inf`` for none, e.g. an
            inactive row), to merge this attention with another part (the sparse prefill's picks).

    Returns:
        the shape of ``q``, float32; with ``return_lse`` also float32 ``[batch, (T,) num_heads]``.

    Raises:
        ValueError: mismatched shapes, a dtype other than float32, or ``block_size`` not dividing the capacity.
        RuntimeError: the kernel is not available (:func:`build_error` says why).
    """
    single, q4, b, t, nq, d, nkv, cap = decode_shapes(q, k_cache, v_cache)
    pos = (q_positions[:, None] if single else q_positions).astype(jnp.int32)
    idx = (topk_idx[:, :, None] if single else topk_idx).astype(jnp.int32)
    if block_size < 1 or cap % block_size:
        raise ValueError(f"cache capacity {cap} is not a multiple of block_size={block_size}")
    if idx.ndim != 4 or idx.shape[:3] != (b, nkv, t):
        raise ValueError(f"topk_idx shape {topk_idx.shape} does not match [batch={b}, kv_heads={nkv}, (T={t},) K]")
    if pos.shape != (b, t):
        raise ValueError(f"q_positions shape {q_positions.shape} does not match q {q.shape}")
    if any(x.dtype != jnp.float32 for x in (q, k_cache, v_cache)):
        raise ValueError(f"the native decode kernel is float32 only (q {q.dtype}, cache {k_cache.dtype}); "
                         "use the XLA reference (model.attention_impl='xla')")
    if min(window_blocks, init_blocks) < 0 or (gather_width is not None and gather_width < 0):
        raise ValueError(f"window_blocks={window_blocks}, init_blocks={init_blocks}, gather_width={gather_width} "
                         "must be >= 0")
    scale = _static_scale(scale, d)
    if not available():
        raise RuntimeError(f"native decode kernel unavailable: {build_error()}")
    if idx.shape[-1] == 0:  # a zero-size operand: pass one unused pick instead
        idx = jnp.full((b, nkv, t, 1), -1, jnp.int32)
    width = idx.shape[-1] if gather_width is None else gather_width
    attrs = dict(block_size=np.int64(block_size), init_blocks=np.int64(init_blocks),
                 window_blocks=np.int64(window_blocks), gather_width=np.int64(width), scale=scale,
                 window_keys=np.int64(_window_keys))
    if return_lse:
        out, lse = jax.ffi.ffi_call(_LSE_TARGET, (jax.ShapeDtypeStruct(q4.shape, jnp.float32),
                                                  jax.ShapeDtypeStruct(q4.shape[:3], jnp.float32)),
                                    vmap_method="sequential")(q4, k_cache, v_cache, idx, pos, **attrs)
        return (out[:, 0], lse[:, 0]) if single else (out, lse)
    out = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q4.shape, jnp.float32), vmap_method="sequential")(
        q4, k_cache, v_cache, idx, pos, **attrs)
    return out[:, 0] if single else out


def dense_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, *, q_positions: jax.Array,
                           scale: float | None = None, window: int | None = None, block_size: int = 64) -> jax.Array:
    """:func:`~minicpm4_jax.ops.decode_ref.dense_decode_attention` by the native kernel: every cache slot
    ``<= q_position`` (with ``window = W``: only the last ``W`` positions ``q_position - W + 1 .. q_position``),
    walked in blocks of ``block_size`` (a divisor of the capacity; any value gives the same result up to
    float rounding). Same shapes as :func:`decode_attention`; float32 only. Several tokens per sequence (``q``
    ``[batch, T, heads, head_dim]``, no window, e.g. a speculative verify chunk) attend as one group of
    ``T x group`` query rows per KV head, each masked after its own position: the cache is read once per
    sequence and KV head instead of once per token.

    Raises:
        ValueError: as :func:`decode_attention`, or ``window < 1``.
    """
    if window is not None and q.ndim != 3:
        raise ValueError(f"window={window} takes one token per sequence (q [batch, heads, head_dim]), got q {q.shape}")
    if window is not None and window < 1:
        raise ValueError(f"window={window} must be >= 1 (positions attended, the query's own included)")
    single = q.ndim == 3
    b, nkv, cap = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    t = 1 if single else q.shape[1]
    blk = block_size if block_size >= 1 and cap % block_size == 0 else 1
    nb = cap // blk
    window_blocks = nb if window is None else min(nb, -(-window // blk) + 1)  # blocks the window can touch
    none = jnp.full((b, nkv, t, 0), -1, jnp.int32)
    return decode_attention(q, k_cache, v_cache, none[:, :, 0] if single else none, q_positions=q_positions,
                            block_size=blk, window_blocks=window_blocks, scale=scale,
                            _window_keys=0 if window is None or window >= cap else int(window))


def supports_selection(params) -> bool:
    """Whether :func:`select_decode_attention` computes this selection exactly as the reference: float32 scores
    and the clean causal rule (the official off-by-one quirk and bfloat16 score storage stay on XLA)."""
    return params.score_dtype == "float32" and not params.kernel_offby1_quirk


def select_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, ck1: jax.Array,
                            ck2: jax.Array | None, *, q_positions: jax.Array, params, init_blocks: int,
                            window_blocks: int, gather_width: int, q_sel: jax.Array | None = None,
                            scale: float | None = None) -> tuple[jax.Array, jax.Array]:
    """InfLLM v2 selection (stage 1, pooling, top-k) and stage 2 of decode queries in one native call.

    The selection is :func:`~minicpm4_jax.infllm.select.select_blocks_compressed` (clean rule, float32 scores:
    :func:`supports_selection`) computed per (sequence, KV head, token) from the compressed-key caches; its
    ``topk_idx`` then feeds :func:`decode_attention` with ``init_blocks`` / ``window_blocks`` /
    ``gather_width`` (:func:`~minicpm4_jax.infllm.attention.stage2_forced_split`). Scores are summed in a
    different order than XLA's, so a pick can differ from the reference where two block scores tie to float
    rounding (either is a top-k block); exact ties (one kernel pooled into two blocks) go to the lower index
    as in ``lax.top_k``.

    Args:
        q: float32 ``[batch, num_heads, head_dim]`` or ``[batch, T, num_heads, head_dim]`` post-RoPE queries.
        k_cache, v_cache: float32 ``[batch, num_kv_heads, capacity, head_dim]``.
        ck1, ck2: float32 ``[batch, Nc, num_kv_heads, head_dim]`` fine / coarse compressed-key caches (``ck2``
            ``None`` for gen-1).
        q_positions: int ``[batch]`` / ``[batch, T]``; ``-1`` = inactive (no picks, zeros out).
        params: :class:`~minicpm4_jax.infllm.select.SelectParams`.
        init_blocks, window_blocks, gather_width: stage 2's forced split.
        q_sel: selection queries when ``use_nope`` (pre-RoPE), default ``q``.
        scale: softmax scale of both stages, default ``head_dim ** -0.5``.

    Returns:
        ``(out, topk_idx)``: the shape of ``q`` (float32) and int32 ``[batch, num_kv_heads, (T,) topk_cfg]`` in
        the :class:`~minicpm4_jax.infllm.select.Selection` format.

    Raises:
        ValueError: bad shapes or dtypes, or a selection :func:`supports_selection` rejects.
        RuntimeError: the kernel is not available.
    """
    if not supports_selection(params):
        raise ValueError(f"native selection needs float32 scores and the clean rule (score_dtype="
                         f"{params.score_dtype!r}, kernel_offby1_quirk={params.kernel_offby1_quirk}); use the "
                         "XLA selection")
    p = params
    if p.variant not in ("gen1", "gen2") or min(p.block_size, p.kernel_size, p.kernel_stride, p.coarse_size,
                                                 p.coarse_stride, p.topk_cfg) < 1 or p.block_size % p.kernel_stride:
        raise ValueError(f"bad selection geometry {params}: build it with infllm.select.select_params")
    if min(window_blocks, init_blocks, gather_width, p.init_blocks, p.local_blocks) < 0:
        raise ValueError(f"window_blocks={window_blocks}, init_blocks={init_blocks}, gather_width={gather_width} "
                         "must be >= 0 (infllm.attention.stage2_forced_split gives them)")
    single, q4, b, t, nq, d, nkv, cap = decode_shapes(q, k_cache, v_cache)
    qs = q4 if q_sel is None else (q_sel[:, None] if single else q_sel)
    pos = (q_positions[:, None] if single else q_positions).astype(jnp.int32)
    gen2 = params.variant == "gen2"
    if gen2 and ck2 is None:
        raise ValueError("gen2 selection needs the coarse compressed keys ck2")
    ck2 = ck1 if ck2 is None else ck2  # unread by gen-1
    for name, x in (("ck1", ck1), ("ck2", ck2)):
        if x.ndim != 4 or x.shape[0] != b or x.shape[2:] != (nkv, d):
            raise ValueError(f"{name} shape {x.shape} does not match [batch={b}, Nc, kv_heads={nkv}, head_dim={d}]")
    if qs.shape != q4.shape or pos.shape != (b, t):
        raise ValueError(f"q_sel {None if q_sel is None else q_sel.shape} / q_positions {q_positions.shape} do "
                         f"not match q {q.shape}")
    if cap % params.block_size:
        raise ValueError(f"cache capacity {cap} is not a multiple of block_size={params.block_size}")
    if any(x.dtype != jnp.float32 for x in (q4, qs, k_cache, v_cache, ck1, ck2)):
        raise ValueError("the native decode kernel is float32 only; use the XLA reference "
                         "(model.attention_impl='xla')")
    sc = _static_scale(scale, d)
    if not available():
        raise RuntimeError(f"native decode kernel unavailable: {build_error()}")
    out, idx = jax.ffi.ffi_call(
        _SELECT_TARGET, (jax.ShapeDtypeStruct(q4.shape, jnp.float32),
                         jax.ShapeDtypeStruct((b, nkv, t, params.topk_cfg), jnp.int32)), vmap_method="sequential")(
        q4, qs, k_cache, v_cache, ck1, ck2, pos, block_size=np.int64(params.block_size),
        kernel_size=np.int64(params.kernel_size), kernel_stride=np.int64(params.kernel_stride),
        coarse_size=np.int64(params.coarse_size), coarse_stride=np.int64(params.coarse_stride),
        sel_init_blocks=np.int64(params.init_blocks), local_blocks=np.int64(params.local_blocks),
        topk_cfg=np.int64(params.topk_cfg), variant=np.int64(2 if gen2 else 1), sel_scale=sc,
        init_blocks=np.int64(init_blocks), window_blocks=np.int64(window_blocks),
        gather_width=np.int64(gather_width), scale=sc)
    return (out[:, 0], idx[:, :, 0]) if single else (out, idx)
