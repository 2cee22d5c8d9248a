"""Benchmark of the fsdp engine on one process (CPU here; the same script runs on GPU).

1. forward_backward + optimizer_step tokens/s against a plain PyTorch training loop
   (transformers forward, log_softmax, backward, AdamW) on the same model and batch;
   equal-length rows, so both do the same work and the ratio is the engine's overhead.
2. Packed vs padded micro-batches on a variable-length batch (tokens/s of real tokens).
3. Weight export (``sync_weights`` into a receiver that keeps nothing) MB/s against a plain
   copy of the same bytes.

4. The main job's update (``--main-job``): the arithmetic GRPO actor step (16 prompts x 8
   samples, 7-12 real tokens each, the main job's model, the GRPO loss, AdamW) through the
   engine (prompts shared, and not) against a plain PyTorch loop on the same batch, both
   clocks (wall and process CPU) in one run.

5. Regional compilation (``--compile``): the update (forward_backward + optimizer_step on
   packed variable-length micro-batches, two batches of different token counts alternating)
   with eager decoder layers against ``options.compile`` (inductor), on the tiny model and
   on a mid-size config, interleaved in one run; the compiled engine's first steps
   (compilation) are reported apart.

Usage: ``python bench/bench_fsdp.py [--repeats 5] [--hidden 256] [--layers 4] [--cpu-time]``;
``python bench/bench_fsdp.py --main-job [--threads 1]``;
``python bench/bench_fsdp.py --compile [--threads 2] [--repeats 10]``;
``python bench/bench_fsdp.py --export-two-ranks`` times the export from 2 FSDP ranks (gloo).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from geartrain.batch import Batch
from geartrain.config import EngineConfig, ModelConfig, OptimConfig
from geartrain.engine import Engine
from geartrain.modeling import build_hf_model
from geartrain.types import EngineContext, LossContext


def loss_fn(outputs: dict[str, torch.Tensor], mb: Batch, ctx: LossContext) -> tuple[torch.Tensor, dict[str, float]]:
    mask = mb["loss_mask"].to(outputs["log_probs"].dtype)
    return -(outputs["log_probs"] * mask).sum() / ctx.global_tokens, {}


def make_batch(rows: int, width: int, variable: bool, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 128, (rows, width), generator=g)
    mask = torch.ones(rows, width, dtype=torch.long)
    if variable:  # lengths uniform in [width/8, width], right padded
        lengths = torch.randint(width // 8, width + 1, (rows,), generator=g)
        mask = (torch.arange(width)[None] < lengths[:, None]).long()
        ids = ids * mask
    loss_mask = mask.clone()
    loss_mask[:, : width // 4] = 0
    return Batch({"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask})


CLOCK = time.perf_counter


def timed(fn, repeats: int) -> float:  # noqa: ANN001
    """Median seconds of ``repeats`` calls after one warm-up, on ``CLOCK``."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = CLOCK()
        fn()
        times.append(CLOCK() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with the process's CPU time instead of wall time (a machine shared with other jobs)",
    )
    args = ap.parse_args()
    global CLOCK
    if args.cpu_time:
        CLOCK = time.process_time

    overrides = dict(
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    model_cfg = ModelConfig(tiny="qwen2", config_overrides=overrides)
    optim = OptimConfig(lr=1e-4)

    def engine(**options: object) -> Engine:
        cfg = EngineConfig(
            backend="fsdp", optim=optim, max_tokens_per_micro_batch=args.rows * args.width, options=dict(options)
        )
        return Engine(cfg, model_cfg, EngineContext(role="actor"))

    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  {platform.machine()}  torch {torch.__version__}  "
        f"threads {torch.get_num_threads()}  clock {'cpu' if args.cpu_time else 'wall'}"
    )
    print(f"# model: qwen2 hidden={args.hidden} layers={args.layers} vocab=128; batch {args.rows} x {args.width}")

    # 1. engine vs plain loop, equal-length rows
    full = make_batch(args.rows, args.width, variable=False)
    tokens = int(full["attention_mask"].sum())
    eng = engine()

    def engine_step() -> None:
        eng.forward_backward(full, loss_fn)
        eng.optimizer_step()

    hf = build_hf_model(model_cfg).train()
    opt = torch.optim.AdamW(
        hf.parameters(), lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay
    )

    def plain_step() -> None:
        ids, mask = full["input_ids"], full["attention_mask"]
        logits = hf(input_ids=ids, attention_mask=mask).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        lm = full["loss_mask"][:, 1:].float()
        loss = -(logp * lm).sum() / lm.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), optim.clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)

    # interleave the two so that load from other processes hits both alike
    t_engine, t_plain = [], []
    for _ in range(args.repeats):
        t_engine.append(timed(engine_step, 1))
        t_plain.append(timed(plain_step, 1))
    te, tp = statistics.median(t_engine), statistics.median(t_plain)
    print(
        f"train step, equal lengths: engine {tokens / te:,.0f} tok/s, plain loop {tokens / tp:,.0f} tok/s, "
        f"ratio {tp / te:.3f}"
    )

    # 2. packed vs padded on variable lengths
    var = make_batch(args.rows, args.width, variable=True, seed=1)
    real = int(var["attention_mask"].sum())
    packed, padded = engine(), engine(remove_padding=False)
    t_packed, t_padded = [], []
    for _ in range(args.repeats):
        t_packed.append(timed(lambda: (packed.forward_backward(var, loss_fn), packed.optimizer_step()), 1))
        t_padded.append(timed(lambda: (padded.forward_backward(var, loss_fn), padded.optimizer_step()), 1))
    tk, td = statistics.median(t_packed), statistics.median(t_padded)
    print(
        f"variable lengths ({real} real of {var['attention_mask'].numel()} slots): packed {real / tk:,.0f} tok/s, "
        f"padded {real / td:,.0f} tok/s, speed-up {td / tk:.2f}x"
    )

    # 3. weight export vs memcpy
    class Sink:
        dtype = torch.float32
        bucket_bytes = 64 << 20

        def update_weights(self, named_tensors) -> None:  # noqa: ANN001
            for _ in named_tensors:
                pass

    sink = Sink()
    stats = eng.sync_weights(sink)
    nbytes = stats.bytes
    params = [p.detach() for p in hf.state_dict().values()]
    copy_bytes = sum(p.numel() * p.element_size() for p in params)
    t_sync, t_copy = [], []
    for _ in range(max(5, args.repeats)):
        t_sync.append(timed(lambda: eng.sync_weights(sink), 1))
        t_copy.append(timed(lambda: [torch.empty_like(p).copy_(p) for p in params], 1))
    ts, tc = statistics.median(t_sync), statistics.median(t_copy)
    print(
        f"weight export: {nbytes / ts / 1e6:,.0f} MB/s ({nbytes / 1e6:.1f} MB, {stats.num_tensors} tensors, "
        f"{stats.num_buckets} buckets); plain copy {copy_bytes / tc / 1e6:,.0f} MB/s; "
        f"ratio {(nbytes / ts) / (copy_bytes / tc):.2f}"
    )


def main_job_batch(prompts: int = 16, n: int = 8, seed: int = 0) -> Batch:
    """The main job's actor batch: ``prompts`` prompts x ``n`` samples, prompt-major as the
    rollout returns them, ``[left pad | prompt (5-7) | response (2-5) | right pad]`` in a
    16 + 5 wide layout, with GRPO advantages and old log-probs."""
    g = torch.Generator().manual_seed(seed)
    width_p, width_r = 16, 5
    rows = prompts * n
    ids = torch.zeros(rows, width_p + width_r, dtype=torch.long)
    att, loss_mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for i in range(prompts):
        p = int(torch.randint(5, 8, (1,), generator=g))
        prompt = torch.randint(4, 20, (p,), generator=g)
        for j in range(n):
            row = i * n + j
            r = int(torch.randint(2, 6, (1,), generator=g))
            ids[row, width_p - p : width_p] = prompt
            ids[row, width_p : width_p + r] = torch.randint(4, 20, (r,), generator=g)
            att[row, width_p - p : width_p + r] = 1
            loss_mask[row, width_p : width_p + r] = 1
    adv = torch.randn(rows, 1, generator=g).expand(rows, width_p + width_r) * loss_mask
    old = torch.zeros(rows, width_p + width_r)
    return Batch(
        {"input_ids": ids, "attention_mask": att, "loss_mask": loss_mask, "advantages": adv, "old_log_probs": old},
        info={"prompt_length": width_p},
    )


def main_job(repeats: int, threads: int) -> None:
    """Engine vs plain loop on the main job's actor update, wall and CPU clocks together."""
    from geartrain.algorithms import ActorLossConfig, make_actor_loss

    torch.set_num_threads(threads)
    overrides = dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    model_cfg = ModelConfig(tiny="qwen2", config_overrides=overrides)
    optim = OptimConfig(lr=1e-4, clip_grad=1.0)
    batch = main_job_batch()
    eng = Engine(EngineConfig(backend="fsdp", optim=optim), model_cfg, EngineContext(role="actor"))
    unshared = Engine(
        EngineConfig(backend="fsdp", optim=optim, options={"share_prompt_prefix": False}),
        model_cfg,
        EngineContext(role="actor"),
    )
    actor_loss = make_actor_loss(ActorLossConfig())

    def engine_step() -> None:
        eng.forward_backward(batch, actor_loss)
        eng.optimizer_step()

    def unshared_step() -> None:
        unshared.forward_backward(batch, actor_loss)
        unshared.optimizer_step()

    hf = build_hf_model(model_cfg).train()
    opt = torch.optim.AdamW(
        hf.parameters(), lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay
    )
    real_cols = batch["attention_mask"].bool().any(0).nonzero().squeeze(1)
    cols = slice(int(real_cols[0]), int(real_cols[-1]) + 1)  # the plain loop skips all-padding columns too

    def plain_step() -> None:
        ids, mask = batch["input_ids"][:, cols], batch["attention_mask"][:, cols]
        position_ids = (mask.cumsum(1) - 1).clamp(min=0)
        logits = hf(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        lm = batch["loss_mask"][:, cols][:, 1:].float()
        ratio = torch.exp(logp - batch["old_log_probs"][:, cols][:, 1:])
        loss = -(ratio * batch["advantages"][:, cols][:, 1:] * lm).sum() / lm.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), optim.clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)

    steps = (("engine", engine_step), ("engine, unshared", unshared_step), ("plain", plain_step))
    for _ in range(3):
        for _, fn in steps:
            fn()
    clocks: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name, _ in steps}
    for _ in range(repeats):  # interleaved, so load from other processes hits all alike
        for name, fn in steps:
            w, c = time.perf_counter(), time.process_time()
            fn()
            clocks[name][0].append(time.perf_counter() - w)
            clocks[name][1].append(time.process_time() - c)
    med = {name: (statistics.median(w), statistics.median(c)) for name, (w, c) in clocks.items()}
    tokens = int(batch["attention_mask"].sum())
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  {platform.machine()}  torch {torch.__version__}  "
        f"threads {threads}  load(1 min) {os.getloadavg()[0]:.1f}"
    )
    print(
        f"main-job actor update: {len(batch)} sequences (16 prompts x 8 samples), {tokens} real tokens, "
        "model hidden 128 x 2 layers"
    )
    for clock, i in (("wall", 0), ("cpu", 1)):
        e, u, p = med["engine"][i], med["engine, unshared"][i], med["plain"][i]
        print(
            f"  {clock:4s}: engine {1000 * e:.1f} ms/step (prompts not shared: {1000 * u:.1f}), "
            f"plain loop {1000 * p:.1f} ms/step, engine speed / plain {p / e:.2f} (unshared {p / u:.2f})"
        )


def compile_bench(repeats: int, threads: int, backend: str = "inductor") -> None:
    """Eager vs compiled decoder layers (``options.compile``) on the update, per model config."""
    torch.set_num_threads(threads)
    configs = {
        "tiny (qwen2 tiny: hidden 64, 2 layers)": ({}, 8, 64),
        "mid (hidden 512, 4 layers, 8 heads / 4 kv, mlp 1536)": (
            dict(
                hidden_size=512,
                intermediate_size=1536,
                num_hidden_layers=4,
                num_attention_heads=8,
                num_key_value_heads=4,
            ),
            8,
            192,
        ),
    }
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  {platform.machine()}  torch {torch.__version__}  "
        f"threads {threads}  load(1 min) {os.getloadavg()[0]:.1f}  backend {backend}  fp32"
    )
    for label, (overrides, rows, width) in configs.items():
        model_cfg = ModelConfig(tiny="qwen2", config_overrides=overrides)
        batches = [make_batch(rows, width, variable=True, seed=s) for s in (1, 2)]
        tokens = [int(b["attention_mask"].sum()) for b in batches]

        def engine(compiled: bool, model_cfg: ModelConfig = model_cfg, budget: int = rows * width) -> Engine:
            options = {"compile": compiled, "compile_backend": backend}
            cfg = EngineConfig(
                backend="fsdp", optim=OptimConfig(lr=1e-4), max_tokens_per_micro_batch=budget, options=options
            )
            return Engine(cfg, model_cfg, EngineContext(role="actor"))

        engines = {"eager": engine(False), "compiled": engine(True)}
        params = sum(p.numel() for p in engines["eager"].handle.hf.parameters())

        def step(eng: Engine, batch: Batch) -> None:
            eng.forward_backward(batch, loss_fn)
            eng.optimizer_step()

        warm = {}
        for name, eng in engines.items():  # the first steps: compilation (both token counts)
            start = time.perf_counter()
            for b in batches:
                step(eng, b)
            warm[name] = time.perf_counter() - start
        times: dict[str, list[float]] = {name: [] for name in engines}
        for i in range(repeats):  # interleaved, so load from other processes hits both alike
            for name, eng in engines.items():
                start = time.perf_counter()
                step(eng, batches[i % 2])
                times[name].append(time.perf_counter() - start)
        med = {name: statistics.median(t) for name, t in times.items()}
        mean_tokens = sum(tokens) / len(tokens)
        print(
            f"{label}: {params / 1e6:.2f}M params, {rows} rows, {tokens[0]} / {tokens[1]} real tokens per batch\n"
            f"  eager    {1000 * med['eager']:8.1f} ms/step  {mean_tokens / med['eager']:9,.0f} tok/s"
            f"  (first two steps {warm['eager']:.1f} s)\n"
            f"  compiled {1000 * med['compiled']:8.1f} ms/step  {mean_tokens / med['compiled']:9,.0f} tok/s"
            f"  (first two steps, compiling: {warm['compiled']:.1f} s)\n"
            f"  compiled speed / eager {med['eager'] / med['compiled']:.2f}x  (median of {repeats}, wall clock)"
        )


def _export_rank(
    rank: int, world: int, store_path: str, hidden: int, layers: int, repeats: int, result_path: str
) -> None:
    """One rank of the 2-rank export benchmark: FSDP-sharded weights gathered over gloo."""
    import os

    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        ov = dict(
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=8,
            num_key_value_heads=4,
        )
        cfg = EngineConfig(backend="fsdp", optim=OptimConfig(lr=1e-4))
        cfg.parallel.dp = world
        eng = Engine(
            cfg,
            ModelConfig(tiny="qwen2", config_overrides=ov),
            EngineContext(role="actor", rank=rank, world_size=world, process_group=dist.group.WORLD),
        )

        class Sink:
            dtype = torch.float32
            bucket_bytes = 64 << 20

            def update_weights(self, named_tensors) -> None:  # noqa: ANN001
                for _ in named_tensors:
                    pass

        sink = Sink() if rank == 0 else None
        stats = eng.sync_weights(sink)
        t = timed(lambda: eng.sync_weights(sink), repeats)
        if rank == 0:
            full = [torch.randn(p.shape) for p in eng.handle.hf.state_dict().values()]
            tc = timed(lambda: [torch.empty_like(p).copy_(p) for p in full], repeats)
            nbytes = sum(p.numel() * p.element_size() for p in full)
            torch.save({"sync": stats.bytes / t, "copy": nbytes / tc, "buckets": stats.num_buckets}, result_path)
    finally:
        dist.destroy_process_group()


def export_two_ranks(hidden: int, layers: int, repeats: int) -> None:
    import os
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.pt")
        mp.start_processes(
            _export_rank,
            args=(2, os.path.join(tmp, "store"), hidden, layers, repeats, result),
            nprocs=2,
            start_method="spawn",
        )
        r = torch.load(result)
    print(
        f"weight export, 2 FSDP ranks (gloo all-gathers): {r['sync'] / 1e6:,.0f} MB/s; "
        f"plain copy {r['copy'] / 1e6:,.0f} MB/s; ratio {r['sync'] / r['copy']:.2f}"
    )


if __name__ == "__main__":
    import sys

    if "--export-two-ranks" in sys.argv:
        export_two_ranks(hidden=256, layers=4, repeats=5)
    elif "--compile" in sys.argv:
        threads = int(sys.argv[sys.argv.index("--threads") + 1]) if "--threads" in sys.argv else 2
        repeats = int(sys.argv[sys.argv.index("--repeats") + 1]) if "--repeats" in sys.argv else 10
        compile_bench(repeats=repeats, threads=threads)
    elif "--main-job" in sys.argv:
        threads = int(sys.argv[sys.argv.index("--threads") + 1]) if "--threads" in sys.argv else 1
        main_job(repeats=30, threads=threads)
    else:
        main()
