"""kvtier's OpenAI-compatible HTTP front door: `/v1/completions`, `/v1/chat/completions`, `/v1/models`.

The gateway owns no model weights and no KV memory: it renders and tokenizes prompts, checks the
request against the model's context, and forwards each completion to the compute replicas as a
`Generate` stream (`kvtier.compute_client.ComputeClient`, with failover). Run it with
`python -m kvtier.gateway` or `kvtier serve`; `kvtier up` starts one beside the stack.
"""
