"""``ServerArgs``: every option of a radixserve server, one frozen dataclass made of one frozen
dataclass per area (``ModelOptions``, ``MemoryOptions``, ``SchedulingOptions``, ``QoSOptions``,
``ServingOptions``, ``DisaggOptions``, ``SpeculativeOptions``). Each area owns its fields, their help and their checks; a
component that needs one area takes that class (``ServerArgs`` is each of them), and the checks that
span areas live here. The CLI is generated from the fields (flag = ``--`` + field name with ``-``;
SGLang's and vLLM's other names for the same option are aliases of its one field), so ``--help``
and ``Engine(**kwargs)`` can never drift apart. "auto" values stay "auto" here and are resolved by
the component that owns them (e.g. the model runner picks the dtype).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from radixserve.config.disagg import DisaggOptions
from radixserve.config.memory import MemoryOptions
from radixserve.config.model import ModelOptions
from radixserve.config.qos import QoSOptions
from radixserve.config.scheduling import SCHEDULE_POLICIES, SchedulingOptions
from radixserve.config.serving import ServingOptions
from radixserve.config.speculative import SpeculativeOptions
from radixserve.options import add_dataclass_cli_args, alias_kwargs, dataclass_from_cli_args


@dataclass(frozen=True)
class ServerArgs(ModelOptions, MemoryOptions, SchedulingOptions, QoSOptions, ServingOptions, DisaggOptions,
                 SpeculativeOptions):
    def __post_init__(self) -> None:
        errors = (self._model_errors() + self._memory_errors() + self._scheduling_errors() + self._qos_errors()
                  + self._serving_errors() + self._disagg_errors() + self._speculative_errors() + self._choice_errors()
                  + self._cross_errors())
        if errors:
            raise ValueError("invalid server arguments: " + "; ".join(errors))

    def _choice_errors(self) -> list[str]:
        errors = []
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value not in choices and not (value is None and f.default is None):  # None: off
                errors.append(f"{f.name} must be one of {', '.join(choices)}; got {value!r}")
        return errors

    def _cross_errors(self) -> list[str]:
        """The checks that read more than one area."""
        errors: list[str] = []
        if self.chunked_prefill_size > 0 and self.page_size > 0 and self.chunked_prefill_size % self.page_size:
            errors.append("chunked_prefill_size must be a multiple of page_size")
        if self.schedule_policy not in SCHEDULE_POLICIES and not self.policy_plugin and ":" not in self.schedule_policy:
            errors.append(f"schedule_policy must be one of {', '.join(SCHEDULE_POLICIES)}, a --policy-plugin "
                          f"policy or module.path:ClassName; got {self.schedule_policy!r}")
        for flag, value in (("--cache-events-port", self.cache_events_port),
                            ("--kv-events-config", self.kv_events_config)):
            if value is not None and self.disable_radix_cache:
                errors.append(f"{flag} reports the radix cache's changes; it cannot be used with "
                              "--disable-radix-cache")
        if self.enable_hierarchical_cache:
            if self.disable_radix_cache:
                errors.append("--enable-hierarchical-cache keeps the radix cache's evicted prefixes; it cannot be "
                              "used with --disable-radix-cache")
            if self.tp_size != 1:
                errors.append("--enable-hierarchical-cache does not support --tp-size > 1 yet (each rank "
                              "would have to store its own heads)")
        if self.disaggregation_mode != "null":
            if self.disable_radix_cache:
                errors.append("--disaggregation-mode hands KV over through the radix cache; it cannot be used "
                              "with --disable-radix-cache")
            if self.tp_size != 1:
                errors.append("--disaggregation-mode does not support --tp-size > 1 yet")
        return errors

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        """``ServerArgs(**kwargs)`` that also takes SGLang's and vLLM's other names of an option
        (``max_num_seqs=8``, ``disable_overlap_schedule=True``), as ``Engine(**kwargs)`` does."""
        return cls(**alias_kwargs(cls, kwargs))

    def replace(self, **changes: Any) -> ServerArgs:
        return dataclasses.replace(self, **alias_kwargs(type(self), changes))

    # --- CLI -----------------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        add_dataclass_cli_args(cls, parser, skip)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ServerArgs:
        return dataclass_from_cli_args(cls, ns)
