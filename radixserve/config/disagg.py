"""The disaggregation area of ``ServerArgs``: prefill/decode workers and how KV moves between them
(SGLang's flag names; radixserve/disagg, docs/scale-out.md)."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.options import option


@dataclass(frozen=True)
class DisaggOptions:
    disaggregation_mode: str = option(
        "null", "Prefill/decode disaggregation: 'prefill' runs prompts and sends their KV to a decode worker, "
        "'decode' receives KV and decodes, 'null' does both (no disaggregation).", ("null", "prefill", "decode"),
        group="server")
    disaggregation_bootstrap_port: int = option(
        8998, "A prefill worker's bootstrap server port (data-parallel rank r: port + r), where decode workers "
        "register the rooms they wait for.", group="server")
    disaggregation_transfer_backend: str = option(
        "zmq", "How KV moves between workers: ZeroMQ over TCP, zero-copy frames.", ("zmq",), group="server")
    num_reserved_decode_tokens: int = option(
        512, "A decode worker refuses a request (429) unless its KV pool keeps this many tokens free for "
        "decoding after reserving the prompt.", group="server")
    disaggregation_timeout_secs: float = option(
        30.0, "Seconds a room may wait for its other half (KV on a decode worker; registration or "
        "acknowledgement on a prefill worker) before it is aborted and its KV freed.", group="server")

    def _disagg_errors(self) -> list[str]:
        errors: list[str] = []
        if self.disaggregation_mode != "null":
            if not 1 <= self.disaggregation_bootstrap_port <= 65535:
                errors.append("disaggregation_bootstrap_port must be in [1, 65535]")
            if not self.disaggregation_timeout_secs > 0:
                errors.append("disaggregation_timeout_secs must be > 0")
            if self.num_reserved_decode_tokens < 0:
                errors.append("num_reserved_decode_tokens must be >= 0")
        return errors
