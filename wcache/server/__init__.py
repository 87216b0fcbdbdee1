"""The daemon: ``cli`` (wcache-server), ``daemon`` (asyncio socket server), ``store``
(model and leases), ``loader`` (safetensors -> slab), ``security``, ``backends``."""
