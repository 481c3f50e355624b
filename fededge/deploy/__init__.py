"""Deployment helpers that import nothing of Flower: certificates and node keys
(:mod:`fededge.deploy.certs`) and the network-namespace testbed
(:mod:`fededge.deploy.testbed`, imported on demand: ``fededge testbed``). The loopback
deployment itself is :mod:`fededge.server.deploy`; docs/deployment.md ties them together."""

from fededge.deploy.certs import CertBundle, CertError, generate_certs, parse_hosts

__all__ = ["CertBundle", "CertError", "generate_certs", "parse_hosts"]
