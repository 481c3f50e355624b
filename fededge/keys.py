"""Every message, record, node-config and ``context.state`` name fededge uses, in one place.

Keys are kebab-case, as Flower's own are. The record names ``arrays`` / ``config`` /
``metrics`` and the weight key ``num-examples`` are the defaults of Flower's
``flwr.serverapp.strategy`` classes, so fededge's ClientApp answers any of them.

Plain strings, no Flower: the client mods, the server strategies and a client written in
another language (docs/wire-format.md) read the same names. The helpers that build and
read the records these names label are :mod:`fededge.protocol`.
"""

# Record names inside a Message's RecordDict (Flower's strategy defaults).
ARRAYS = "arrays"
CONFIG = "config"
METRICS = "metrics"

# Metrics a client puts in its train reply.
NUM_EXAMPLES = "num-examples"  # FedAvg's weight: the client's local training-set size
TRAIN_LOSS = "train-loss"  # mean loss over the local steps of this round
COMPUTE_S = "compute-s"  # measured seconds of local computation for this message
LOCAL_STEPS_DONE = "local-steps-done"
# The client's place in the data split, so that the server's simulated clock can give
# it its link profile (node ids are random; partition ids are what users assign).
REPLY_PARTITION_ID = "partition-id"
REPLY_NUM_PARTITIONS = "num-partitions"
# A client the run config's ``dropout`` fraction takes out replies with this metric (1)
# and nothing else, at once; the server's grid turns the reply into an error (no answer)
# and the simulated clock charges the round-timeout (fededge.server.metering).
DROPPED_OUT = "dropped-out"
# Start of the error reason of a reply from a client whose configuration cannot work (its
# run config, node config or data split; fededge.clients.mods.config_error_mod). The
# server stops the run on it, naming the client, instead of counting a failure per round.
# fededge.protocol.config_error_reason / config_error_detail write and read it.
CONFIG_ERROR = "fededge-config-error"

# Compressed updates (fededge.clients.mods.CompressionMod, fededge.strategies.compressed).
COMPRESSED = "compressed"  # reply record: one uint8 array, the bundle of wire payloads
COMPRESSED_DOWN = "compressed-down"  # the same, for the model the server broadcasts
BUNDLE = "bundle"  # the array's name in those records
UNCOMPRESSED = "arrays-uncompressed"  # non-float tensors (BatchNorm's counters), as they are

# Keys of the ConfigRecord the server sends with each train message.
SERVER_ROUND = "server-round"
LOCAL_STEPS = "local-steps"
LOCAL_LR = "local-lr"
MOMENTUM = "momentum"
WEIGHT_DECAY = "weight-decay"
BATCH_SIZE = "batch-size"
LR_SCHEDULE = "lr-schedule"  # with the two below: the client computes its round's local-lr
LR_WARMUP_ROUNDS = "lr-warmup-rounds"
NUM_ROUNDS = "num-rounds"  # the run's length, for the lr schedule
PROXIMAL_MU = "proximal-mu"  # set by flwr's FedProx in configure_train

# Node config (set by Flower's simulation, or by ``flower-supernode --node-config``).
PARTITION_ID = "partition-id"
NUM_PARTITIONS = "num-partitions"
DATA_DIR = "data-dir"
WORKER_SOCKET = "worker-socket"  # the node's warm worker (fededge.clients.shim); else $FEDEDGE_WORKER_SOCKET
CACHE_DIR = "cache-dir"  # the node cache's directory (fededge.nodecache), ``off`` disables it
STATE_DIR = "state-dir"  # where the node keeps its state for a resume (fededge.clients.statestore)
# Set (True) by fededge's in-process runtime (fededge.server.grid) in every node's config:
# it keeps idle nodes' states on disk itself (client_states="disk"), and holds them in its
# checkpoints, so fededge's app adds no StateSpillMod there.
INPROCESS_NODE = "fededge-inprocess"
# Node config, set by the in-process runtime: the device its device=auto chose, by
# measurement, for every client of the run (fededge.server.inprocess.client_device_choice).
CLIENT_DEVICE = "fededge-client-device"

# Run-config key: "disk" keeps idle nodes' context.state on disk (fededge.clients.app adds
# fededge.clients.statestore.StateSpillMod; the in-process runtime spills itself).
CLIENT_STATES = "client-states"

# Names of the records fededge keeps in a node's ``context.state``.
STATE_SAMPLER = "fededge.sampler"
STATE_MOMENTUM = "fededge.momentum"  # keep-momentum: the local optimiser's buffers, kept across rounds
STATE_DGA = "fededge.dga"  # DGA: the client's local model and its updates in flight
STATE_COMPRESS = "fededge.compress"  # the update encoder's state (residuals, PowerSGD's Q, DGC)
STATE_STORE = "fededge.state-store"  # the run and attempt whose state this context holds
# ... and in the server's: where fededge's ServerApp leaves the run directory (``run-dir``)
# for a caller holding the Context (fededge.server.inprocess.run_inprocess).
SERVER_RESULT_KEY = "fededge.result"

# A node's state kept on its disk for a resumed run (fededge.clients.statestore): train
# config the server sends when its runtime does not keep the clients' states.
STATE_KEY = "state-key"  # the run's id (the same after a resume)
STATE_RESUMED_FROM = "state-resumed-from"  # the checkpoint round the run continues after (0: fresh)
STATE_ATTEMPT = "state-attempt"  # a new id each time the server starts
# the attempt that wrote the checkpoint a run continues from, and the round that one continued after
STATE_BASE_ATTEMPT = "state-base-attempt"
STATE_BASE_FROM = "state-base-from"
STATE_EVERY = "state-every"  # checkpoint-every: which rounds the server may resume from

# Normalisation statistics of the server's model (norm-stats = global):
# fededge.strategies.normstats.NormCalibrated asks, fededge.protocol.norm_stats_content answers.
NORM_STATS_ACTION = "norm_stats"  # the ClientApp's @app.query(NORM_STATS_ACTION)
NORM_STATS_QUERY = "query." + NORM_STATS_ACTION  # the message type
NORM_STATS_BATCHES = "norm-stats-batches"  # int in the query's config: mini-batches per client
NORM_STATS = "norm-stats"  # the answer's record: one bundle of raw payloads (as COMPRESSED)

# Delayed Gradient Averaging (fededge.strategies.dga): train config the server sends ...
DGA_GLOBAL_ROUND = "dga-global-round"  # g: the round of the global model the client holds
DGA_CORRECTION = "dga-correction"  # bool: swap the own stale update for the average
# ... and metrics the client replies with.
DGA_STALENESS = "dga-staleness"  # rounds of own updates whose average had not arrived

# Previews (fededge.clients.preview; DGA's compute-ahead): records of a message that
# carry the next message's content, and the record that refers to such content instead.
PREVIEW_PREFIX = "fededge.preview/"  # "fededge.preview/<name>": the next message's record <name>
PREVIEW_ID = "fededge.preview-id"  # ConfigRecord {"id": str}: the id of the preview carried
PREVIEW_OF = "fededge.preview-of"  # ConfigRecord {"id": str}: this message's content is that preview

# Gossip (fededge.strategies.gossip): train config the server sends ...
GOSSIP_INDEX = "gossip-index"  # int: this node's index in the topology
GOSSIP_ALGORITHM = "gossip-algorithm"  # "dpsgd" | "choco"
GOSSIP_GAMMA = "gossip-gamma"  # CHOCO's consensus step size
GOSSIP_ROW_NODES = "gossip-row-nodes"  # list[int]: the nonzero entries of row i of W ...
GOSSIP_ROW_WEIGHTS = "gossip-row-weights"  # list[float]: ... and their weights (node i included)
GOSSIP_EVAL = "gossip-eval"  # bool: also reply with the trained model, for evaluation only
# ... records in the train message: "gossip/<j>" (neighbour j's message of the previous
# round) and, when the server resynchronises a CHOCO node, "gossip-hat/<j>" (x̂_j) ...
GOSSIP_FROM = "gossip/"
GOSSIP_HAT = "gossip-hat/"
# ... and records in the reply: the node's gossip message, and its model for evaluation.
GOSSIP_MESSAGE = "gossip"
GOSSIP_EVAL_ARRAYS = "gossip-eval"
STATE_GOSSIP = "fededge.gossip"  # the node's trained model, CHOCO estimates, own q
