"""The CUDA-graph step (training/step.py, the default on CUDA): eager on CPU; on a GPU,
replayed steps equal eager ones bit for bit, refresh what is cached from the parameters,
skip a non-finite step on the device, resume bit for bit, and fall back to eager steps when
the step cannot be captured.

Tiny models (d_model 16, 2 layers); the GPU tests run with `-m gpu` on a CUDA machine.
"""

from __future__ import annotations

import pytest
import torch
from training_helpers import ListData, random_batch, tcfg, tiny_lm, weights_of

from mambakit.training import TrainConfig, Trainer, lm_loss
from mambakit.training.trainer import count_targets


def test_cuda_graph_auto_trains_eagerly_on_cpu():
    trainer = Trainer(tiny_lm(), tcfg(), ListData([random_batch()]), log=lambda s: None)
    assert TrainConfig().cuda_graph == "auto"
    assert not trainer.use_graph and trainer.graph_status().startswith("eager")
    trainer.train_step()
    assert trainer.step == 1 and trainer._graph is None
    with pytest.raises(ValueError, match="cuda_graph"):
        TrainConfig(cuda_graph="yes")


def poison_batch(batch: dict[str, torch.Tensor], value: float) -> dict[str, torch.Tensor]:
    return {**batch, "poison": torch.tensor([value])}


def poison_loss(model, batch, state):
    """lm_loss plus first_param * poison: an input tensor, so it works inside a replay."""
    loss, state = lm_loss(model, {k: v for k, v in batch.items() if k != "poison"}, state)
    p = next(model.parameters())
    return loss + (p * batch["poison"].to(p.dtype)).sum(), state


def gpu_trainer(data, graph, **kw) -> Trainer:
    fields = dict(device="cuda", precision="bf16", lr=1e-2, cuda_graph=graph, deterministic=True)
    fields.update(kw)
    return Trainer(tiny_lm(), tcfg(**fields), data, log=lambda s: None)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "kw",
    [{}, {"grad_accum": 2}, {"tbptt_len": 8}, {"tbptt_len": 8, "tbptt_grad_chunks": 2}],
    ids=["plain", "accum2", "tbptt8", "tbptt8-k2"],
)
def test_graph_steps_equal_eager_steps(kw, restore_determinism):
    """Captured and replayed, the step gives the eager step's losses and weights bit for bit
    (deterministic mode), through gradient accumulation, TBPTT and the lr schedule."""
    batches = [random_batch(seed=s) for s in range(3)]
    runs = {}
    for graph in (False, True):
        trainer = gpu_trainer(ListData(batches), graph, warmup_steps=2, **kw)
        losses = [float(trainer.train_step()[0]) for _ in range(5)]
        assert (trainer._graph is not None) == graph
        runs[graph] = (losses, weights_of(trainer.model))
    assert runs[True][0] == runs[False][0]
    for n, w in runs[True][1].items():
        assert torch.equal(w, runs[False][1][n]), n


@pytest.mark.gpu
@needs_cuda
def test_graph_steps_refresh_what_is_cached_from_the_parameters(restore_determinism):
    """A replayed step updates the parameters in place where PyTorch does not see it; their
    version counters must still move, or what is cached from them without autograd (the
    decode plan's A = -exp(A_log), D, dt bias) would keep its first values: evaluation after
    graph training would then run a model that is not the one trained (and saved)."""
    batches = [random_batch(seed=s) for s in range(2)]
    trainer = gpu_trainer(ListData(batches), True)
    trainer.train_step()
    assert trainer._graph is not None
    bb = trainer.model.backbone
    mixer = bb.layers[0].mixer
    first = bb._decode_plan()[0].A.clone()  # the decode plan
    for _ in range(3):
        trainer.train_step()
    A = bb._decode_plan()[0].A
    assert torch.equal(A, -torch.exp(mixer.A_log.float()))
    assert not torch.equal(A, first)  # training moved A_log
    # the trainer's validation loss is the loss of the weights it has, as a fresh copy sees them
    fresh = tiny_lm().cuda()
    fresh.load_state_dict(trainer.model.state_dict())
    val = [random_batch(seed=9)]
    trainer.val_batches = val
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):  # as gpu_trainer's
        expected, _ = lm_loss(fresh, {k: v.cuda() for k, v in val[0].items()}, None)
    expected = float(expected) / int(count_targets(val[0]))
    assert trainer.evaluate() == pytest.approx(expected, rel=1e-5)


@pytest.mark.gpu
@needs_cuda
def test_graph_step_skips_a_non_finite_step_on_the_device(restore_determinism):
    good, bad = poison_batch(random_batch(), 0.0), poison_batch(random_batch(), float("inf"))
    trainer = Trainer(
        tiny_lm(),
        tcfg(device="cuda", precision="bf16", lr=1e-2),
        ListData([good, good, bad, good]),
        loss_fn=poison_loss,
        log=lambda s: None,
    )
    trainer.train_step()
    trainer.train_step()
    assert trainer._graph is not None and trainer.skipped_steps == 0
    w = weights_of(trainer.model)
    opt = {id(p): {k: v.clone() for k, v in s.items()} for p, s in trainer.optimizer.state.items()}
    trainer.train_step()  # inf in the loss and the gradients: skipped inside the replay
    assert trainer.skipped_steps == 1
    for n, v in weights_of(trainer.model).items():
        assert torch.equal(v, w[n]), n
    for p, s in trainer.optimizer.state.items():
        for k, v in s.items():
            assert torch.equal(v, opt[id(p)][k]), k
    trainer.train_step()
    assert trainer.skipped_steps == 1
    assert any(not torch.equal(v, w[n]) for n, v in weights_of(trainer.model).items())
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


@pytest.mark.gpu
@needs_cuda
def test_graph_resume_is_bit_identical(tmp_path, restore_determinism):
    batches = [random_batch(seed=s) for s in range(4)]

    def make():
        return Trainer(
            tiny_lm(),
            tcfg(device="cuda", precision="bf16", lr=1e-2, warmup_steps=3, steps=6,
                 deterministic=True, run_dir=str(tmp_path)),
            ListData(batches),
            log=lambda s: None,
        )  # fmt: skip

    straight = make()
    for _ in range(6):
        straight.train_step()
    first = make()
    for _ in range(3):
        first.train_step()
    first.save()
    resumed = make()
    assert resumed.resume()
    for _ in range(3):
        resumed.train_step()
    assert resumed._graph is not None
    for n, v in weights_of(resumed.model).items():
        assert torch.equal(v, weights_of(straight.model)[n]), n


@pytest.mark.gpu
@needs_cuda
def test_a_loss_that_syncs_the_host_falls_back_to_eager(restore_determinism):
    def syncing_loss(model, batch, state):
        loss, state = lm_loss(model, batch, state)
        if float(loss) < 0:  # a host sync: not capturable
            raise AssertionError
        return loss, state

    said = []
    batches = [random_batch(seed=s) for s in range(2)]
    stream = torch.cuda.current_stream()
    trainer = Trainer(
        tiny_lm(),
        tcfg(device="cuda", precision="bf16", lr=1e-2, deterministic=True),
        ListData(batches),
        loss_fn=syncing_loss,
        log=said.append,
    )
    rng = torch.cuda.get_rng_state()
    losses = [float(trainer.train_step()[0]) for _ in range(3)]
    assert not trainer.use_graph and trainer._graph is None
    assert any("cuda graph off" in s for s in said), said
    # the failed capture left the caller's stream current and the default generator where
    # it was (a step draws no random numbers): random ops work and continue its sequence
    assert torch.cuda.current_stream() == stream
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    same = torch.Generator(device="cuda")
    same.set_state(rng)
    drawn = torch.randn(64, device="cuda")
    assert torch.equal(drawn, torch.randn(64, device="cuda", generator=same))
    eager = gpu_trainer(ListData(batches), False)
    assert losses == [float(eager.train_step()[0]) for _ in range(3)]
    for n, v in weights_of(trainer.model).items():
        assert torch.equal(v, weights_of(eager.model)[n]), n


def test_snapshot_is_on_the_host_and_restores_weights_and_optimizer_state():
    """`_restore` puts back what `_snapshot` took: the weights and the optimizer state (on
    the CPU the skip counters are the host's, so the snapshot has none). That the snapshot
    lives in host memory on a GPU too is checked by the peak-memory test below."""
    trainer = Trainer(tiny_lm(), tcfg(lr=1e-2), ListData([random_batch()]), log=lambda s: None)
    trainer.train_step()  # optimizer state exists
    before = {n: v.clone() for n, v in weights_of(trainer.model).items()}
    state_before = {
        id(p): {k: v.clone() for k, v in trainer.optimizer.state[p].items()} for p in trainer.params
    }
    snap = trainer._snapshot()
    params, opt, skipped, streak = snap
    assert all(t.device.type == "cpu" for t in params) and skipped is None and streak is None
    assert all(v.device.type == "cpu" for d in opt.values() for v in d.values())
    trainer.train_step()
    assert any(not torch.equal(v, before[n]) for n, v in weights_of(trainer.model).items())
    trainer._restore(snap)
    for n, v in weights_of(trainer.model).items():
        assert torch.equal(v, before[n]), n
    for p in trainer.params:
        for k, v in trainer.optimizer.state[p].items():
            assert torch.equal(v, state_before[id(p)][k]), k


@pytest.mark.gpu
@needs_cuda
def test_graph_step_peaks_no_higher_than_the_eager_step(restore_determinism):
    """The capture's warm-up steps run beside the snapshot of the weights: in host memory, it
    adds nothing to the GPU's peak. A model whose weights outweigh its activations (47M
    parameters, 188 MB in f32): the captured step's first call (warm-up steps, capture,
    replay) peaks less than half the weights' bytes above an eager step's (a device snapshot
    adds all of them; the side and capture streams' cuBLAS workspaces are 32 MiB each)."""
    import gc

    peaks = {}
    for graph in (False, True):
        gc.collect()  # the Trainer and its model sit in a reference cycle
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        model = tiny_lm(d_model=1024, n_layers=2, vocab=32768)
        weight_bytes = sum(p.numel() * 4 for p in model.parameters())
        trainer = Trainer(
            model, tcfg(device="cuda", precision="bf16", lr=1e-2, cuda_graph=graph),
            ListData([random_batch(T=8)]), log=lambda s: None,
        )  # fmt: skip
        for _ in range(2):
            trainer.train_step()
        torch.cuda.synchronize()
        assert (trainer._graph is not None) == graph
        peaks[graph] = torch.cuda.max_memory_allocated()
        if graph:
            params, opt, _, _ = trainer._snapshot()
            assert all(t.device.type == "cpu" for t in params)
            assert all(v.device.type == "cpu" for d in opt.values() for v in d.values())
        del trainer, model
    assert weight_bytes > 150e6
    assert peaks[True] - peaks[False] < 0.5 * weight_bytes, (peaks, weight_bytes)


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])],
)
@pytest.mark.parametrize("clip", [0.05, 1e3], ids=["binds", "loose"])
def test_clip_in_the_fused_adamw_equals_clipping_the_gradients_first(
    device, clip, restore_determinism
):
    """The Trainer's AdamW is fused (CUDA, and the CPU where PyTorch has the kernel) and the
    clip rides in it (`grad_scale`: each gradient divided by max(1, (norm + 1e-6) /
    max_norm) as the step reads it). Its steps equal those of clip_grad_norm_ followed by
    the step: to a rounding of the quotient where the clip binds (a division against a
    product), bit for bit where it does not (a division by 1)."""
    batches = [random_batch(seed=s) for s in range(3)]
    runs = {}
    for fold in (True, False):
        if device == "cuda":
            trainer = gpu_trainer(ListData(batches), False, grad_clip=clip)
        else:
            trainer = Trainer(tiny_lm(), tcfg(grad_clip=clip, lr=1e-2), ListData(batches),
                              log=lambda s: None)  # fmt: skip
        assert all(g["fused"] for g in trainer.optimizer.param_groups)
        assert trainer._grad_scale is not None
        assert trainer.optimizer.grad_scale is trainer._grad_scale
        if not fold:  # clip_grad_norm_ scales the gradients, then the step reads them as they are
            del trainer.optimizer.grad_scale
        norms = [float(trainer.train_step()[1]) for _ in range(4)]
        runs[fold] = norms, weights_of(trainer.model)
    (norms, w), (norms_ref, w_ref) = runs[True], runs[False]
    assert norms[0] == norms_ref[0]  # the first step's gradients are the same tensors
    binds = clip < norms_ref[0]
    assert binds == (clip == 0.05)
    init = weights_of(tiny_lm())
    assert any(not torch.equal(v.cpu(), init[n]) for n, v in w.items())  # it trained
    for n, v in w.items():
        if binds:
            torch.testing.assert_close(v, w_ref[n], rtol=1e-5, atol=1e-6, msg=n)
        else:
            assert torch.equal(v, w_ref[n]), n


def test_an_optimizer_put_in_the_trainers_place_still_clips():
    """The clip is folded only into the optimizer the Trainer made: one put in its place
    gets clip_grad_norm_, so a binding clip still binds (the update of a step with the
    clip at 1e-3 is smaller than without it)."""
    batches = [random_batch(seed=s) for s in range(2)]
    moved = {}
    for clip in (1e-3, 0.0):
        trainer = Trainer(tiny_lm(), tcfg(grad_clip=clip, lr=1e-2), ListData(batches),
                          log=lambda s: None)  # fmt: skip
        trainer.optimizer = torch.optim.SGD(trainer.params, lr=1.0)
        before = [p.detach().clone() for p in trainer.params]  # (tied weights once)
        trainer.train_step()
        moved[clip] = (
            sum(float((p.detach() - b).norm() ** 2) for p, b in zip(trainer.params, before)) ** 0.5
        )
    assert moved[1e-3] == pytest.approx(1e-3, rel=1e-3)  # SGD at lr 1 moves by the clipped norm
    assert moved[0.0] > 1e-2


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["f64", "bf16"])
def test_clip_of_a_model_not_in_float32_steps_as_clip_grad_norm_then_adamw(dtype):
    """A float64 or bf16 model keeps clip_grad_norm_ (the fused kernel's scale is float32):
    with a clip that binds, its step equals clipping first and then an unfused AdamW of the
    same groups and settings (to rounding: float64 tight, bf16 parameters to their
    precision)."""
    from mambakit.training.optim import param_groups

    batch = random_batch(seed=3)
    weights = {}
    for fused in (True, False):
        model = tiny_lm().to(dtype)
        cfg = tcfg(grad_clip=0.05, lr=1e-2)
        trainer = Trainer(model, cfg, ListData([batch]), log=lambda s: None)
        assert trainer._grad_scale is None
        if not fused:  # the oracle: foreach AdamW, clip_grad_norm_ by the trainer
            trainer.optimizer = torch.optim.AdamW(
                param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps
            )
        if fused:
            assert all(g["fused"] for g in trainer.optimizer.param_groups)
        _, norm = trainer.train_step()
        assert float(norm) > 0.05  # the clip binds
        weights[fused] = weights_of(model)
    init = weights_of(tiny_lm().to(dtype))
    tol = dict(rtol=1e-12, atol=1e-14) if dtype == torch.float64 else dict(rtol=2e-2, atol=1e-3)
    for n, v in weights[True].items():
        assert torch.isfinite(v).all(), n
        torch.testing.assert_close(v, weights[False][n], **tol, msg=n)
    assert any(not torch.equal(v, init[n]) for n, v in weights[True].items())
