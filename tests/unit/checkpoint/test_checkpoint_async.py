"""checkpoint.async_save: the state is copied when the save is called (later updates do not leak into it), and
the checkpoint becomes `latest` only once finished (at the next save or the end of the run)."""

import torch

from megatron_composer.checkpoint import dcp


def test_async_save_captures_the_state_at_the_call_and_publishes_on_finish(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    meta = {"model": {"kind": "mlp"}}

    def train_step():
        model(torch.randn(4, 8)).square().sum().backward()
        opt.step()
        opt.zero_grad()

    train_step()
    dcp.save_checkpoint(tmp_path, 1, model, opt, {"step": 1}, meta)
    train_step()
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: opt.state[p]["exp_avg"].clone() for k, p in model.named_parameters()}
    pending = dcp.save_checkpoint(tmp_path, 2, model, opt, {"step": 2}, meta, async_save=True)
    for _ in range(3):  # training goes on while the writer thread works
        train_step()
    assert isinstance(pending, dcp.PendingCheckpoint)
    assert dcp.find_latest(tmp_path).name == "step_1"  # not visible before it is finished
    assert pending.finish() == tmp_path / "checkpoints" / "step_2"
    assert dcp.find_latest(tmp_path).name == "step_2"

    fresh = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert dcp.load_checkpoint(dcp.find_latest(tmp_path), fresh, fresh_opt, meta)["step"] == 2
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in at_save.items())
    assert all(torch.equal(fresh_opt.state[p]["exp_avg"], moments[k]) for k, p in fresh.named_parameters())
