"""The trainer side: the policy and its chunked logprobs (``policy``, ``prefix``), the batch plan (``plan``), ranks and
sharding (``parallel``), the weight flow to the engines (``weights``), and a Lightning fix (``lightning_compat``)."""
