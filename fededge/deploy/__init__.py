"""Deployment tooling, none of it the ServerApp and none of it importing Flower.

- :mod:`fededge.deploy.certs`: certificates and SuperNode keys (``fededge certs``);
- :mod:`fededge.deploy.procs`: processes and Flower's command line, shared by the three
  tools below;
- :mod:`fededge.deploy.launch`: ``flwr run`` on Flower's local simulation SuperLink,
  cleaned up afterwards (``fededge simulate``);
- :mod:`fededge.deploy.local`: ``LocalDeployment``, a SuperLink and SuperNodes on
  loopback;
- :mod:`fededge.deploy.testbed`: SuperNodes in network namespaces (``fededge testbed``).

Only the certificates are imported here; the rest on demand. docs/deployment.md ties them
together."""

from fededge.deploy.certs import CertBundle, CertError, generate_certs, parse_hosts

__all__ = ["CertBundle", "CertError", "generate_certs", "parse_hosts"]
