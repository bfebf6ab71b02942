"""The guard's communication device follows the model over a real gloo group (issue 23, 7 and 8)."""

from __future__ import annotations

import pytest
import torch
from device_ranks import comm_follows_model

from replicheck.harness.launch import node_names, run_local


@pytest.mark.timeout(200)
def test_the_guards_communication_device_is_decided_from_the_model_and_the_groups_backend() -> None:
    """DDP, FSDP2 and CPU-offloaded FSDP2 each ask for their communication device with the
    group's backend configuration and the model's compute device (FSDP's own compute device
    under offload), get the host under gloo, and a verification step of the offloaded model runs.
    Under offload the compute device is FSDP's parameter groups' device, not where the offloaded
    parameters are stored (shown with a stand-in device name on the groups)."""
    ranks = run_local(comm_follows_model, node_names(2, 1), timeout=150)
    cpu = torch.device("cpu")
    for out in ranks:
        for kind in ("ddp", "fsdp", "offload"):
            (config, compute), comm, device = out[kind]
            assert config == out["config"] and "gloo" in config, kind
            assert compute == device == cpu and comm == cpu, kind
        assert out["verified"]
        found, stored = out["stand_in"]
        assert found == torch.device("cuda", 1) and stored == {cpu}
