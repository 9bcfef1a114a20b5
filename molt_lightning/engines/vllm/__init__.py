"""vLLM's room: the in-process engine (``engine``), a remote ``molt serve`` server (``remote``, ``server``), the weight
phases both write once over their transport (``phases``), the worker extension that runs inside vLLM (``worker``,
reading weights back: ``readback``, ``names``), LoRA adapters (``lora``), shared-memory slabs (``shm``), NCCL
(``nccl``), and ``cpu``: everything that exists only for vLLM's CPU platform, asked once whether it applies."""
