"""The run's loopback endpoint (``endpoint``) and the two wires it speaks: OpenAI chat completions (``openai_chat``)
and Anthropic messages (``anthropic_messages``), with the request checks both share (``checks``)."""
