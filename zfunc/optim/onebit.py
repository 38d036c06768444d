"""1-bit Adam, 0/1 Adam and 1-bit LAMB (re-exported by ``zfunc.optim``): optimizers that communicate
themselves, with DeepSpeed's algorithms (Tang et al. 2021; Lu et al. 2022; Li et al. 2021).

After a full-precision warm-up (equal to ``adamw(..., bias_correction=False)`` / ``lamb(...,
bias_correction=False)`` exactly: the same code runs), the variance is frozen and the step hands each
rank its *own* grads (``GradientTransformation.local_grads(state)`` is True: stage 0 skips its grad
all-reduce); the optimizer all-reduces its momentum instead, 1-bit compressed with error feedback
(``Comm.compressed_all_reduce``, ``compressed_all_reduce_many``: ~32x fewer bytes than an fp32 all-reduce of
the grads).

Each param tensor is compressed on its own (its own scales and ``ErrorFeedback``), as DeepSpeed's
1-bit and 0/1 Adam do; 1-bit LAMB scales every momentum to one magnitude and sends them as one
message. Errors (the feedback buffers) are not part of the state: the transformation keeps them and
restarts them at zero whenever the state it is given is not the one its last update returned (told
by the count): a loaded checkpoint or a fresh process starts with zero errors, as DeepSpeed drops
them on ``load_state_dict``. ``momentum_mask``: a pytree shaped like params, of 0/1 tensors (or None
leaves), multiplied into the momentum after each compressed all-reduce, for params whose grads are
always zero in some entries (DeepSpeed's ``exp_avg_mask``: compression would otherwise make them
nonzero).

``comm``: the ``zf.dist.Comm`` of the data-parallel ranks (``mesh.comm``); None: one over the default
process group, made at the first compressed update (one rank alone: no compression happens).
The step runs them at ``zf.shard`` stage 0 (replicated data parallelism, where DeepSpeed runs them),
alone or inside ``zf.pipeline`` (pass ``comm=mesh.comm``: each stage's dp ranks); the rulebook refuses
stages 1-3, whose grads are reduce-scattered slices.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from zfunc.core import tree
from zfunc.optim.adam import AdamState, _adam_update
from zfunc.optim.base import (GradientTransformation, MaskOrFn, PyTree, ScalarOrSchedule, _check_betas, _check_int,
                              _check_non_negative, _check_number, _grad_leaves, _mask_leaves, _update_in_place)
from zfunc.optim.kernels import _zeros_like
from zfunc.optim.lamb import _check_coeffs, lamb_direction, trust_ratio
from zfunc.optim.onebit_channel import _Channel
from zfunc.optim.schedules import _as_schedule


def _local_momentum(m: torch.Tensor, g: torch.Tensor, b1: float) -> torch.Tensor:
    """``m b1 + (1 - b1) g``: ``zfunc.ops.cpu.onebit``'s one pass on fp32 CPU tensors (the same bits), else torch."""
    from zfunc.ops.cpu import onebit as cpu_onebit

    if cpu_onebit.usable(m, g.contiguous()):
        return cpu_onebit.local_momentum(m, g.contiguous(), b1)
    return m * b1 + (1 - b1) * g


def _frozen_update(p32: torch.Tensor, m: torch.Tensor, v: torch.Tensor, lr: float, decay: float | None,
                   eps: float) -> torch.Tensor:
    """The update of ``p = p decay - lr m / (sqrt(v) + eps)`` on a frozen ``v`` (``decay`` None: none):
    ``zfunc.ops.cpu.onebit``'s one pass on fp32 CPU tensors (its square root correctly rounded), else torch."""
    from zfunc.ops.cpu import onebit as cpu_onebit

    if cpu_onebit.usable(p32, m, v):
        return cpu_onebit.frozen_adam_update(p32, m, v, lr, decay, eps)
    new_p = p32 * decay if decay is not None else p32
    return new_p - lr * (m / (v.sqrt() + eps)) - p32


def _masked(m: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return m if mask is None else m * mask.to(m.device, m.dtype)


def _mask_list(momentum_mask: PyTree | None, params: PyTree, n: int) -> list[Any]:
    if momentum_mask is None:
        return [None] * n
    leaves = tree.structure(params).flatten_up_to(momentum_mask)
    if len(leaves) != n:
        raise ValueError(f"momentum_mask: expected one tensor (or None) per parameter ({n}), got {len(leaves)}")
    return leaves


def _check_common(b1, b2, eps, weight_decay, freeze_step_name, freeze_step):
    _check_betas(b1=b1, b2=b2)
    _check_number("eps", eps, "a finite float > 0", lambda x: x > 0)
    _check_non_negative(weight_decay=weight_decay)
    _check_int(freeze_step_name, freeze_step, 0)


def onebit_adam(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                weight_decay: float = 0.0, freeze_step: int = 100000, mask: MaskOrFn = None,
                momentum_mask: PyTree | None = None, comm: Any = None) -> GradientTransformation:
    """1-bit Adam (DeepSpeed's ``OneBitAdam``). Updates 1..``freeze_step``: ``adamw(...,
    bias_correction=False)`` on the grads averaged by the step (equal to it exactly). After: each
    rank's momentum takes its own grad, ``m = b1 m + (1-b1) g_local``, then ``m`` <- its 1-bit
    compressed mean over the ranks (error feedback); ``v`` stays frozen; ``p = p (1 - lr wd) - lr m /
    (sqrt(v) + eps)``. Cost after warm-up: ~1/16 of the fp32 grad all-reduce's bytes or less (~1/32
    on large tensors). State: ``AdamState(count, mu, nu)``, as ``adamw``'s. Module docstring: errors,
    ``momentum_mask``, ``comm``."""
    _check_common(b1, b2, eps, weight_decay, "freeze_step", freeze_step)
    lr = _as_schedule(learning_rate)
    hyper = dict(lr=lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, decoupled=True, mask=mask,
                 bias_correction=False)
    channel = _Channel(comm)

    def leaves_of(grads, state, params):  # grads (and their treespec), params, m, v, decay and momentum masks, live
        g_leaves, treespec = _grad_leaves(grads, params)
        p_leaves, m_leaves, v_leaves = tree.leaves(params), tree.leaves(state.mu), tree.leaves(state.nu)
        n = len(p_leaves)
        live = [k for k, g in enumerate(g_leaves) if g is not None]
        return (g_leaves, treespec, p_leaves, m_leaves, v_leaves, _mask_leaves(mask, params, n),
                _mask_list(momentum_mask, params, n), live)

    def update(grads, state, params=None):
        if state.count < freeze_step:
            return _adam_update(grads, state, params, **hyper)
        channel.check(state.count)
        g_leaves, treespec, p_leaves, m_leaves, v_leaves, decay, masks, live = leaves_of(grads, state, params)
        local = [_local_momentum(m_leaves[k], g_leaves[k].to(m_leaves[k].dtype), b1) for k in live]
        mean = dict(zip(live, channel.mean(local, f"1-bit Adam momentum at update {state.count + 1}", own=True)))
        step_lr = lr(state.count)
        updates, mus = [], []
        for k, (p, m, v, d) in enumerate(zip(p_leaves, m_leaves, v_leaves, decay)):
            if k not in mean:
                updates.append(None)
                mus.append(m)
                continue
            m = _masked(mean[k], masks[k])
            updates.append(_frozen_update(p.to(m.dtype), m, v, step_lr, 1 - step_lr * weight_decay
                                          if (weight_decay and d) else None, eps))
            mus.append(m)
        channel.done(state.count + 1)
        return tree.unflatten(treespec, updates), AdamState(state.count + 1, tree.unflatten(treespec, mus), state.nu)

    def apply(grads, state, params):
        """``update`` and its updates added into ``params``, the same bits, consuming its arguments: on fp32
        CPU tensors after warm-up the momentum is formed, all-reduced and masked in ``mu``'s own tensors and
        each param updated in the update's pass (``zfunc.ops.cpu.onebit``): no new tensor of a param's size."""
        if state.count < freeze_step or not _in_place_ok(grads, state, params):
            return _update_in_place(update, grads, state, params)
        channel.check(state.count)
        from zfunc.ops.cpu import onebit as cpu_onebit

        g_leaves, treespec, p_leaves, m_leaves, v_leaves, decay, masks, live = leaves_of(grads, state, params)
        step_lr = lr(state.count)

        def step_param(j):  # live leaf j's mean is in its m, still in the cache: mask it, update its param
            k = live[j]
            m = m_leaves[k] if masks[k] is None else m_leaves[k].mul_(masks[k].to(m_leaves[k].device, torch.float32))
            cpu_onebit.frozen_adam_apply_(p_leaves[k], m, v_leaves[k], step_lr, 1 - step_lr * weight_decay
                                          if (weight_decay and decay[k]) else None, eps)

        # the local momentum b1 m + (1 - b1) g is formed in the compression's first pass; its mean lands in m
        channel.mean([m_leaves[k] for k in live], f"1-bit Adam momentum at update {state.count + 1}", own=True,
                     blend=([g_leaves[k] for k in live], b1, 1 - b1), then=step_param)
        channel.done(state.count + 1)
        return params, AdamState(state.count + 1, state.mu, state.nu)

    return GradientTransformation(lambda params: AdamState(0, _zeros_like(params), _zeros_like(params)), update,
                                  apply, lambda state: lr(state.count),
                                  local_grads=lambda state: state.count >= freeze_step)


def _in_place_ok(grads: PyTree, state: AdamState, params: PyTree) -> bool:
    """Every grad (or None), param, momentum and variance an fp32 contiguous CPU tensor, each of its param's
    size: ``onebit_adam``'s in-place ``apply`` runs on them (``zfunc.ops.cpu.onebit``)."""
    from zfunc.ops.cpu import onebit as cpu_onebit

    g_leaves = tree.structure(params).flatten_up_to(grads)
    return all(cpu_onebit.usable(*([p, m, v] if g is None else [p, m, v, g]))
               for p, m, v, g in zip(tree.leaves(params), tree.leaves(state.mu), tree.leaves(state.nu), g_leaves))


class ZeroOneAdamState(NamedTuple):
    """``count``, ``mu``, ``nu`` as Adam's; ``buffer``: the params' change since the last sync (frozen
    phase); ``lrs``: the learning rates summed since it; ``var_interval``/``var_counter``: when ``nu``
    updates next; ``local_interval``/``local_counter``: how many local steps between syncs."""

    count: int
    mu: PyTree
    nu: PyTree
    buffer: PyTree
    lrs: float
    var_interval: int
    var_counter: int
    local_interval: int
    local_counter: int


def zero_one_adam(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                  weight_decay: float = 0.0, var_freeze_step: int = 100000, var_update_scaler: int = 16,
                  local_step_scaler: int = 32678, local_step_clipper: int = 16, mask: MaskOrFn = None,
                  momentum_mask: PyTree | None = None, comm: Any = None) -> GradientTransformation:
    """0/1 Adam (DeepSpeed's ``ZeroOneAdam``). Update t (from 1), until ``var_freeze_step + 1``:
    where ``t % var_interval == 0`` a full-precision Adam step on the averaged grads (``adamw(...,
    bias_correction=False)``'s, exactly), counted: every ``var_update_scaler`` of them double
    ``var_interval`` (1 at first: the first ``var_update_scaler`` updates are that Adam exactly);
    other updates take ``m = b1 m + (1-b1) g`` with ``g`` the 1-bit compressed mean of the ranks'
    own grads, ``v`` unchanged. After (``v`` frozen for good, errors restarted once): local steps on
    each rank's own grads, the params' change kept in ``buffer``; every ``local_interval`` updates the
    ranks sync: the change less its weight decay, scaled by ``sqrt(v) + eps``, is 1-bit all-reduced,
    replaces the local one (the decay applied on the shared params) and sets ``m = -change / lrs``
    (DeepSpeed's sends the decay too and so folds it into ``m``); every ``local_step_scaler`` updates
    ``local_interval`` doubles, up to ``local_step_clipper``. Cost: a compressed all-reduce on
    var-free updates, and one per ``local_interval`` updates once frozen (none between).
    Module docstring: errors, masks, comm."""
    _check_common(b1, b2, eps, weight_decay, "var_freeze_step", var_freeze_step)
    for name, value in (("var_update_scaler", var_update_scaler), ("local_step_scaler", local_step_scaler),
                        ("local_step_clipper", local_step_clipper)):
        _check_int(name, value, 1)
    lr = _as_schedule(learning_rate)
    hyper = dict(lr=lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, decoupled=True, mask=mask,
                 bias_correction=False)
    channel = _Channel(comm)

    def frozen(state) -> bool:  # the variance froze after update var_freeze_step + 1
        return state.count > var_freeze_step

    def update(grads, state, params=None):
        t = state.count + 1
        channel.check(state.count)
        if not frozen(state):
            if t % state.var_interval == 0:
                new, adam = _adam_update(grads, AdamState(state.count, state.mu, state.nu), params, **hyper)
                counter, interval = state.var_counter + 1, state.var_interval
                if counter == var_update_scaler:
                    counter, interval = 0, interval * 2
                out = state._replace(count=t, mu=adam.mu, nu=adam.nu, var_interval=interval, var_counter=counter)
            else:
                new, out = _compressed_grad_step(grads, state, params, t)
            if out.count > var_freeze_step:  # frozen from the next update on: errors restart once
                channel.reset()
            channel.done(t)
            return new, out
        new, out = _local_step(grads, state, params, t)
        channel.done(t)
        return new, out

    def _compressed_grad_step(grads, state, params, t):
        g_leaves, treespec = _grad_leaves(grads, params)
        masks = _mask_list(momentum_mask, params, len(g_leaves))
        live = [k for k, g in enumerate(g_leaves) if g is not None]
        mean = dict(zip(live, channel.mean([g_leaves[k] for k in live], f"0/1 Adam grads at update {t}")))
        m_leaves = tree.leaves(state.mu)
        onebit = [None if k not in mean else _masked(mean[k], masks[k]).to(m_leaves[k].dtype)
                  for k in range(len(g_leaves))]
        mus = [m if g is None else m * b1 + (1 - b1) * g for m, g in zip(m_leaves, onebit)]
        updates = _adam_direction_updates(params, onebit, mus, tree.leaves(state.nu), lr(state.count))
        return (tree.unflatten(treespec, updates),
                state._replace(count=t, mu=tree.unflatten(treespec, mus)))

    def _adam_direction_updates(params, g_leaves, mus, nus, step_lr):
        p_leaves = tree.leaves(params)
        decay = _mask_leaves(mask, params, len(p_leaves))
        updates = []
        for p, g, m, v, d in zip(p_leaves, g_leaves, mus, nus, decay):
            if g is None:
                updates.append(None)
                continue
            p32 = p.to(m.dtype)
            new_p = p32 * (1 - step_lr * weight_decay) if (weight_decay and d) else p32
            updates.append(new_p - step_lr * (m / (v.sqrt() + eps)) - p32)
        return updates

    def _local_step(grads, state, params, t):
        g_leaves, treespec = _grad_leaves(grads, params)
        p_leaves, v_leaves = tree.leaves(params), tree.leaves(state.nu)
        m_leaves, b_leaves = tree.leaves(state.mu), tree.leaves(state.buffer)
        masks = _mask_list(momentum_mask, params, len(p_leaves))
        step_lr = lr(state.count)
        mus = [m if g is None else m * b1 + (1 - b1) * g.to(m.dtype) for m, g in zip(m_leaves, g_leaves)]
        steps = _adam_direction_updates(params, g_leaves, mus, v_leaves, step_lr)
        bufs = [b if u is None else b + u for b, u in zip(b_leaves, steps)]
        lrs = state.lrs + step_lr
        updates = list(steps)
        if t % state.local_interval == 0:
            live = [k for k, u in enumerate(steps) if u is not None]
            denoms = {k: v_leaves[k].sqrt() + eps for k in live}
            decays = _sync_decays(p_leaves, steps, bufs, live, lrs * weight_decay,
                                  _mask_leaves(mask, params, len(p_leaves)))
            scaled = [(bufs[k] - decays[k]) * denoms[k] for k in live]
            synced = dict(zip(live, channel.mean(scaled, f"0/1 Adam sync at update {t}")))
            for k in live:
                change = _masked(synced[k], masks[k])
                mus[k] = -change / lrs
                # the local change is undone, the decay since the sync and the synced moment step applied
                updates[k] = steps[k] - bufs[k] + decays[k] + change / denoms[k]
                bufs[k] = torch.zeros_like(bufs[k])
            lrs = 0.0
        counter, interval = state.local_counter + 1, state.local_interval
        if counter == local_step_scaler:
            counter, interval = 0, min(local_step_clipper, interval * 2)
        unflat = lambda xs: tree.unflatten(treespec, xs)  # noqa: E731
        return unflat(updates), state._replace(count=t, mu=unflat(mus), buffer=unflat(bufs), lrs=lrs,
                                               local_interval=interval, local_counter=counter)

    def init(params):
        return ZeroOneAdamState(0, _zeros_like(params), _zeros_like(params), _zeros_like(params), 0.0, 1, 0, 1, 0)

    def local_grads(state) -> bool:
        return frozen(state) or (state.count + 1) % state.var_interval != 0

    return GradientTransformation(init, update, None, lambda state: lr(state.count), local_grads=local_grads)


def _sync_decays(p_leaves, steps, bufs, live, rate: float, decay) -> dict:
    """Per live leaf, the decoupled weight decay since the last sync, ``-rate * p_sync`` (``rate``: the
    learning rates summed since it times ``weight_decay``; ``p_sync = p + step - buffer``, the params
    the ranks shared then), zeros where the leaf does not decay. The sync sends the buffer less this,
    the moment steps alone, so the momentum it rebuilds (``-change / lrs``) holds no decay: with the
    decay in it, every sync would fold ``weight_decay * p * (sqrt(v) + eps)`` into ``m`` and the decay
    would act ~``1 / (1 - b1)`` times over. Exact at one local step per sync; over H steps it ignores
    the decay of the moment steps within the interval (second order in the learning rate)."""
    out = {}
    for k in live:
        p32 = p_leaves[k].to(bufs[k].dtype)
        out[k] = -rate * (p32 + steps[k] - bufs[k]) if (rate and decay[k]) else torch.zeros_like(bufs[k])
    return out


class OneBitLambState(NamedTuple):
    """``count``, ``mu``, ``nu`` as LAMB's; ``nu_fresh``: the variance kept on from the momentum's
    reconstructed grads once frozen; ``coeff_freeze``: per leaf, the running mean of the trust
    ratios of the warm-up; ``last_factor``: per leaf, the last scaling factor; ``scaling``: per leaf,
    the momentum's scaling coefficient before compression (zeros until the first compressed update)."""

    count: int
    mu: PyTree
    nu: PyTree
    nu_fresh: PyTree
    coeff_freeze: tuple
    last_factor: tuple
    scaling: tuple


def onebit_lamb(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                weight_decay: float = 0.0, freeze_step: int = 100000, max_coeff: float = 10.0,
                min_coeff: float = 0.01, coeff_beta: float = 0.9, factor_max: float = 4.0, factor_min: float = 0.5,
                factor_threshold: float = 0.1, mask: MaskOrFn = None, momentum_mask: PyTree | None = None,
                comm: Any = None) -> GradientTransformation:
    """1-bit LAMB (DeepSpeed's ``OneBitLamb``). Updates 1..``freeze_step``: ``lamb(...,
    bias_correction=False)`` (equal to it exactly), keeping per leaf ``coeff_freeze``, the running
    mean (``coeff_beta``) of its trust ratios. After: every leaf's momentum takes its own grad, is
    scaled to a common magnitude (``scaling``, fixed at the first compressed update), 1-bit all-
    reduced as one flat message, unscaled; ``v`` is frozen and ``nu_fresh`` follows the grads the
    momentum implies; the trust ratio is ``coeff_freeze * factor``, ``factor = max(denom / denom_fresh)``
    (mixed with 1 by the decay's share of the update where ``weight_decay``), clamped to
    ``[factor_min, factor_max]`` and to ``last_factor * (1 +- factor_threshold)``. Cost after warm-up:
    one compressed all-reduce of all momenta. Module docstring: errors, masks, comm."""
    _check_common(b1, b2, eps, weight_decay, "freeze_step", freeze_step)
    _check_coeffs(min_coeff, max_coeff)
    _check_betas(coeff_beta=coeff_beta)
    _check_number("factor_min", factor_min, "a finite float > 0", lambda x: x > 0)
    _check_number("factor_max", factor_max, f"a finite float >= factor_min ({factor_min})", lambda x: x >= factor_min)
    _check_non_negative(factor_threshold=factor_threshold)
    lr = _as_schedule(learning_rate)
    channel = _Channel(comm)

    def init(params):
        n = len(tree.leaves(params))
        return OneBitLambState(0, _zeros_like(params), _zeros_like(params), _zeros_like(params), (0.0,) * n,
                               (1.0,) * n, (0.0,) * n)

    def warm_up(grads, state, params):
        g_leaves, treespec = _grad_leaves(grads, params)
        p_leaves, m_leaves, v_leaves = tree.leaves(params), tree.leaves(state.mu), tree.leaves(state.nu)
        decay = _mask_leaves(mask, params, len(p_leaves))
        t, step_lr = state.count + 1, lr(state.count)
        updates, mus, nus, coeffs = [], [], [], list(state.coeff_freeze)
        for k, (g, p, m, v, d) in enumerate(zip(g_leaves, p_leaves, m_leaves, v_leaves, decay)):
            if g is None:
                updates.append(None)
                mus.append(m)
                nus.append(v)
                continue
            g, p32 = g.to(m.dtype), p.to(m.dtype)
            m = m * b1 + (1 - b1) * g
            v = v * b2 + (1 - b2) * g * g
            u = lamb_direction(m, v, p32, eps=eps, weight_decay=weight_decay if d else 0.0)
            ratio = trust_ratio(p32, u, min_coeff, max_coeff)
            if ratio != 1.0:
                coeffs[k] = coeff_beta * coeffs[k] + (1 - coeff_beta) * ratio
            updates.append(-(step_lr * ratio) * u)
            mus.append(m)
            nus.append(v)
        unflat = lambda xs: tree.unflatten(treespec, xs)  # noqa: E731
        fresh = unflat([v.clone() for v in nus]) if t == freeze_step else state.nu_fresh
        return unflat(updates), state._replace(count=t, mu=unflat(mus), nu=unflat(nus), nu_fresh=fresh,
                                               coeff_freeze=tuple(coeffs))

    def compressed(grads, state, params):
        channel.check(state.count)
        g_leaves, treespec = _grad_leaves(grads, params)
        p_leaves, m_leaves = tree.leaves(params), tree.leaves(state.mu)
        v_leaves, f_leaves = tree.leaves(state.nu), tree.leaves(state.nu_fresh)
        decay = _mask_leaves(mask, params, len(p_leaves))
        masks = _mask_list(momentum_mask, params, len(p_leaves))
        t, step_lr = state.count + 1, lr(state.count)
        scaling = state.scaling if all(state.scaling) else _scaling(m_leaves)
        local = [(m * b1 + (1 - b1) * g.to(m.dtype) if g is not None else m) * s
                 for m, g, s in zip(m_leaves, g_leaves, scaling)]
        mean = channel.mean(local, f"1-bit LAMB momentum at update {t}", together=True)
        updates, mus, fresh, factors = [], [], [], list(state.last_factor)
        for k, (p, m_last, v, vf, d) in enumerate(zip(p_leaves, m_leaves, v_leaves, f_leaves, decay)):
            m = _masked(mean[k] / scaling[k], masks[k])
            g_rebuilt = (m - m_last * b1) / (1 - b1)
            vf = vf * b2 + (1 - b2) * g_rebuilt * g_rebuilt
            p32 = p.to(m.dtype)
            denom = v.sqrt() + eps
            prelim = m / denom
            u = prelim + weight_decay * p32 if (weight_decay and d) else prelim
            factor = float((denom / (vf.sqrt() + eps)).max())
            if weight_decay and d:
                share = min(1.0, float(prelim.norm() / u.norm()))
                factor = factor * share + (1.0 - share)
            factor = min(max(factor, factor_min), factor_max)
            last = factors[k]
            factor = min(max(factor, last * (1.0 - factor_threshold)), last * (1.0 + factor_threshold))
            factors[k] = factor
            updates.append(-(step_lr * state.coeff_freeze[k] * factor) * u)
            mus.append(m)
            fresh.append(vf)
        channel.done(t)
        unflat = lambda xs: tree.unflatten(treespec, xs)  # noqa: E731
        return unflat(updates), state._replace(count=t, mu=unflat(mus), nu_fresh=unflat(fresh),
                                               last_factor=tuple(factors), scaling=tuple(scaling))

    def update(grads, state, params=None):
        if params is None:
            raise ValueError("params: onebit_lamb needs the current params for its trust ratio, got None")
        return warm_up(grads, state, params) if state.count < freeze_step else compressed(grads, state, params)

    return GradientTransformation(init, update, None, lambda state: lr(state.count),
                                  local_grads=lambda state: state.count >= freeze_step)


def _scaling(momenta: list[torch.Tensor]) -> tuple[float, ...]:
    """Per leaf, ``mean scale / its scale`` (scale: ``||m|| / sqrt(numel)``), so every leaf's momentum
    enters the one compressed message at a common magnitude (1 where a momentum is zero)."""
    scales = [float(torch.linalg.vector_norm(m)) / max(m.numel(), 1) ** 0.5 for m in momenta]
    united = sum(scales) / max(len(scales), 1)
    return tuple(united / s if s > 0 else 1.0 for s in scales)
