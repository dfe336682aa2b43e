"""The three distributed layouts of docs/distributed.md (section "The three layouts, per rank") run as written, in 2
gloo processes, and give the single-process loss, metrics and gradients. Each ```py block there is the body of one
rank's training step; this test execs the exact text in every rank."""

import os
import re
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PAGE = Path(__file__).resolve().parent.parent / "docs" / "distributed.md"
NAMES = ("tp", "cp", "dp")


def _blocks():
    text = PAGE.read_text()
    section = text[text.index("\n## The three layouts, per rank\n"):]
    end = section.find("\n## ", 1)
    section = section if end < 0 else section[:end]
    blocks = re.findall(r"```py\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 3, len(blocks)
    return dict(zip(NAMES, blocks))


def close(a, b, tol=1e-4):
    a, b = torch.as_tensor(a).detach().double(), torch.as_tensor(b).detach().double()
    return float((a - b).abs().max()) <= tol * max(1.0, float(b.abs().max()))


def check_tp(ns):
    import fused_is
    w = ns["full_weight"].clone().requires_grad_()
    h = ns["hidden"].detach().clone().requires_grad_()
    ref = fused_is.policy_loss(h @ w.T, ns["tokens"], ns["advantages"], sampler_logprobs=ns["sampler_lp"],
                              old_logprobs=ns["old_lp"].detach(), config="ppo_tis")
    ref.loss.backward()
    r, W, V = ns["rank"], ns["world"], ns["V"]
    assert close(ns["out"].loss, ref.loss), (ns["out"].loss, ref.loss)
    assert close(ns["weight"].grad, w.grad[r * V // W:(r + 1) * V // W])
    assert close(ns["hidden"].grad, h.grad)
    assert close(ns["old_lp"], ref.logprobs)


def check_cp(ns):
    import fused_is
    full = ns["full_logits"].clone().requires_grad_()
    ref = fused_is.policy_loss(full, ns["tokens"], ns["advantages"], sampler_logprobs=ns["sampler_lp"], mask=ns["mask"],
                               config="seq_tis")
    ref.loss.backward()
    assert close(ns["out"].loss, ref.loss), (ns["out"].loss, ref.loss)
    assert close(ns["logits"].grad, full.grad[:, ns["cut"]])
    for key, value in ref.metrics.items():
        assert abs(ns["out"].metrics[key] - value) <= 1e-4 * max(1, abs(value)), key


def check_dp(ns):
    import fused_is
    world = dist.get_world_size()
    gathered = [None] * world
    dist.all_gather_object(gathered, ns["micro"])
    lin = ns["model"].module
    w0 = (lin.weight + 0.1 * lin.weight.grad).detach().clone().requires_grad_()  # SGD, lr 0.1, no momentum
    b0 = (lin.bias + 0.1 * lin.bias.grad).detach().clone().requires_grad_()
    allm = [m for rank_micro in gathered for m in rank_micro]
    cat = lambda key: torch.cat([m[key] for m in allm])
    ref = fused_is.policy_loss(cat("hidden") @ w0.T + b0, cat("tokens"), cat("advantages"),
                               sampler_logprobs=cat("sampler_lp"), mask=cat("mask"), config="ppo_tis")
    ref.loss.backward()
    assert close(lin.weight.grad, w0.grad), float((lin.weight.grad - w0.grad).abs().max())
    assert close(lin.bias.grad, b0.grad)




def _worker(rank, world, port, name, block):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        ns = {"__name__": "readme"}
        exec(compile(block, str(PAGE), "exec"), ns)
        globals()["check_" + name](ns)
        dist.barrier()  # every rank done with every collective before any tears its process group down
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_readme_layout_runs_on_two_ranks(name):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, name, _blocks()[name]), nprocs=2, join=True)
