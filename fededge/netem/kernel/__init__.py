"""Kernel backend: shape a real Linux interface with tc qdiscs, through netlink.

Build, then apply (mininet's ``TCIntf`` habit), one module each:

- :mod:`~fededge.netem.kernel.plan`: :func:`plan_apply` and :func:`plan_clear` turn a
  :class:`~fededge.netem.profiles.LinkProfile` into a list of operations (frozen
  dataclasses, pure data, testable without root); the qdisc tree and its sizing are
  described there.
- :mod:`~fededge.netem.kernel.netlink`: :func:`apply` executes such a list with pyroute2
  (no ``tc`` binary) and rolls back everything it did when one operation fails, so an
  interface is never left half-shaped.

The command line (``fededge netem apply | clear``) is in :mod:`fededge.netem.cli`.

Directions
----------
On a CLIENT host (``side="client"``, the default) an interface's egress carries the
uplink (``profile.up``) and its ingress the downlink (``profile.down``). On a server
(``side="server"``) the two swap.

Example
-------
>>> from fededge.netem import kernel
>>> from fededge.netem.profiles import get_profile
>>> plan = kernel.plan_apply("eth0", get_profile("4g"), direction="both")
>>> kernel.apply(plan)  # doctest: +SKIP
"""

from fededge.netem.kernel.netlink import (
    ApplyFailed, DeviceNotFound, KernelFeatureMissing, KernelShapingError, NeedsRootError,
    ShapingConflict, apply, clear, device_mtu, encode_netem, encode_tbf, read_state,
)
from fededge.netem.kernel.plan import (
    CHILD_HANDLE, INGRESS_HANDLE, ROOT_HANDLE, AddFilter, AddIfb, AddQdisc, DelFilter, DelLink,
    DelQdisc, LinkUp, NetemParams, Op, ShapingState, TbfParams, TraceNotSupported,
    default_ifb_name, netem_params, plan_apply, plan_clear, tbf_params,
)

__all__ = [
    "AddIfb", "LinkUp", "AddQdisc", "AddFilter", "DelQdisc", "DelFilter", "DelLink", "Op",
    "TbfParams", "NetemParams", "ShapingState",
    "KernelShapingError", "KernelFeatureMissing", "NeedsRootError", "DeviceNotFound",
    "ShapingConflict", "ApplyFailed", "TraceNotSupported",
    "ROOT_HANDLE", "CHILD_HANDLE", "INGRESS_HANDLE",
    "default_ifb_name", "tbf_params", "netem_params", "plan_apply", "plan_clear",
    "read_state", "apply", "clear", "encode_netem", "encode_tbf", "device_mtu",
]
