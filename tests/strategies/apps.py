"""ClientApps the strategy tests share."""

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fededge import keys
from fededge.clients.app import run_config_mods
from fededge.clients.app import train as fededge_train


def failing_once(partition: int, at_round: int) -> ClientApp:
    """fededge's ClientApp (its train function with the mods the run config asks for),
    except that ``partition`` raises in round ``at_round``."""
    app = ClientApp()

    @app.train(mods=[run_config_mods])
    def train(msg: Message, context: Context) -> Message:
        conf = msg.content[keys.CONFIG]
        if int(context.node_config[keys.PARTITION_ID]) == partition and int(conf[keys.SERVER_ROUND]) == at_round:
            raise RuntimeError(f"partition {partition} fails round {at_round}")
        return fededge_train(msg, context)

    return app


def losing_state_once(partition: int, at_round: int) -> ClientApp:
    """fededge's ClientApp, except that ``partition``'s ``context.state`` is wiped before
    its round ``at_round`` message (a SuperNode that restarted and lost it)."""
    app = ClientApp()

    def wipe(msg: Message, context: Context, call_next):  # noqa: ANN001, ANN202
        if int(context.node_config[keys.PARTITION_ID]) == partition and int(msg.metadata.group_id) == at_round:
            context.state.clear()
        return call_next(msg, context)

    @app.train(mods=[wipe, run_config_mods])
    def train(msg: Message, context: Context) -> Message:
        return fededge_train(msg, context)

    return app
