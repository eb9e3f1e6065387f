"""Prefill/decode disaggregation, the worker side (docs/scale-out.md).

A prefill worker runs a prompt, samples the first token and sends the prompt's KV to the decode
worker that registered the transfer's ``bootstrap_room``; the decode worker decodes from there.
``transfer`` moves the bytes (ZeroMQ behind ``KVSender`` / ``KVReceiver``), ``prefill`` and
``decode`` keep each side's rooms, their timeouts and their KV accounting.
"""
