"""A user's own Flower app, in the shape of Flower's quickstart-pytorch: its own model,
data, train function and run-config keys (``num-server-rounds``, ``my-lr``,
``local-steps``), none of which fededge knows. The tests add fededge's pieces to it the
way a user would: mods on the ClientApp, a wrapper or strategy on the server.

Seeded with local generators only; nothing here touches torch's global RNG.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy
from torch import nn

from fededge.server.grid import InProcessGrid, run_server

RUN_CONFIG = {"num-server-rounds": 5, "my-lr": 0.5, "local-steps": 5, "not-fededge": "at all"}
FEATURES, HIDDEN, CLASSES, PER_CLIENT = 16, 32, 3, 60


class Net(nn.Module):
    """16 -> 32 -> 3: the first layer (512 weights) is large enough to be compressed."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def initial_arrays(seed: int = 0) -> ArrayRecord:
    g = torch.Generator().manual_seed(seed)
    return ArrayRecord({k: 0.3 * torch.randn(v.shape, generator=g) for k, v in Net().state_dict().items()})


def _blobs(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    centers = np.random.default_rng(1234).standard_normal((CLASSES, FEATURES)) * 1.5
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, n)
    x = centers[y] + rng.standard_normal((n, FEATURES))
    return torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y)


def load_data(partition_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _blobs(100 + partition_id, PER_CLIENT)


TEST_X, TEST_Y = _blobs(7, 600)


def evaluate_model(arrays: ArrayRecord) -> tuple[float, float]:
    net = Net()
    net.load_state_dict(arrays.to_torch_state_dict())
    with torch.no_grad():
        logits = net(TEST_X)
    return float(nn.functional.cross_entropy(logits, TEST_Y)), float((logits.argmax(1) == TEST_Y).float().mean())


def train_fn(msg: Message, context: Context) -> Message:
    """The user's train function: load ``arrays``, a few full-batch SGD steps, reply."""
    net = Net()
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = load_data(int(context.node_config["partition-id"]))
    opt = torch.optim.SGD(net.parameters(), lr=float(context.run_config["my-lr"]))
    losses = []
    for _ in range(int(context.run_config["local-steps"])):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    metrics = MetricRecord({"train-loss": sum(losses) / len(losses), "num-examples": len(x)})
    return Message(RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": metrics}), reply_to=msg)


def client_app(mods: Sequence = (), *, app_mods: Sequence = ()) -> ClientApp:
    """The user's ClientApp with fededge's mods added (on the whole app or on train)."""
    app = ClientApp(mods=list(app_mods))
    app.train(mods=list(mods))(train_fn)
    return app


def server_app(make_strategy: Callable[[Context], Strategy], history: dict[int, tuple[float, float]]) -> ServerApp:
    """The user's ServerApp: the strategy ``make_strategy`` builds, the user's own rounds
    key, the test set evaluated each round into ``history`` (round -> loss, accuracy)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        def evaluate_fn(rnd: int, arrays: ArrayRecord) -> MetricRecord:
            history[rnd] = evaluate_model(arrays)
            return MetricRecord({"loss": history[rnd][0], "accuracy": history[rnd][1]})

        result = make_strategy(context).start(
            grid=grid, initial_arrays=initial_arrays(), num_rounds=int(context.run_config["num-server-rounds"]),
            evaluate_fn=evaluate_fn)
        history[-1] = evaluate_model(result.arrays)

    return app


def run(make_strategy: Callable[[Context], Strategy], clients: ClientApp, *, num_nodes: int = 4,
        run_config: dict | None = None) -> tuple[dict[int, tuple[float, float]], InProcessGrid]:
    """Train the user's app in-process; returns the per-round test (loss, accuracy),
    with the final model's at key -1, and the grid (its nodes' contexts)."""
    history: dict[int, tuple[float, float]] = {}
    grid = InProcessGrid(clients, num_nodes=num_nodes, run_config=run_config or RUN_CONFIG)
    # Flower's strategies sample nodes with the global ``random``: seed it for the run (the
    # order of the replies is the order of FedAvg's sums) and give the caller its state back.
    outer = random.getstate()
    random.seed(0)
    try:
        run_server(server_app(make_strategy, history), grid)
    finally:
        random.setstate(outer)
    return history, grid
