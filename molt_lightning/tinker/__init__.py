"""``molt tinker``: the Tinker API served from molt's pieces (outside ``molt fit``'s imports; the ``tinker`` extra).

``server`` (routes, futures, ordering), ``training`` (the LoRA policy, the Tinker losses, AdamW, durable state),
``sampling`` (frozen samplers on molt's engines), ``wire`` (the SDK's protobuf bodies). docs/tinker.md.
"""
