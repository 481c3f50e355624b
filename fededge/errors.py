"""Errors a user of the library may raise or catch, apart from the app's run config.

:class:`ConfigError` marks a configuration that cannot work: fededge's run config
(:mod:`fededge.config` raises it, naming the key), a node config, a data split, or a
user's own settings. Raised in a ClientApp behind
:func:`fededge.clients.mods.config_error_mod`, it becomes a named error reply on which
fededge's server stops the run. It lives here, not in :mod:`fededge.config`, so that the
client mods do not import fededge's own run-config parsing.

Pure: no Flower, no torch.
"""

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration (a run-config key, a node config, a data split) cannot work.

    The message names the setting and says what would be accepted.

    Examples
    --------
    >>> raise ConfigError("run-config key 'my-lr' must be > 0, got -1")
    Traceback (most recent call last):
    ...
    fededge.errors.ConfigError: run-config key 'my-lr' must be > 0, got -1
    """
