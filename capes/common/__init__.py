"""The floor: what every CAPES component may import.

Config loading, parameter specs, the wire protocol, the replay DB, CURVE keys, the
plug-in registry, the stop signal, the control-plane client and its generated stubs,
the deployment config, statistics and atomic file writes. Nothing here imports a
component (``monitor_agent``, ``control_agent``, ``interface_daemon``, ``drl_engine``,
``storagegamesim``) or anything of ``capes.experiments`` or the CLI;
``tests/test_layering.py`` enforces it.
"""
