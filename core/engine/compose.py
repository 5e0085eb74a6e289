"""Composition: an algorithm that augments another algorithm ("PCFL(FedAvg)", "PCFL(Ditto)", ...).

A *wrapper* is a trainer or aggregator class, registered like any other, that has a classmethod
``wrap(base_cls) -> type``. It is never instantiated itself: the core builds the class that ``wrap`` returns for
the *base algorithm* the configuration names, typically ``type(f"PCFL[{base.__name__}]", (Mixin, base), {})``,
so the mixin's methods run around the base's through ``super()``. Optional class attributes of a wrapper:

- ``default_base`` (str): the algorithm wrapped when the config does not name one (default ``"fedavg"``);
- ``can_wrap(base_cls) -> Optional[str]`` (classmethod): why ``base_cls`` cannot be wrapped, or None.

The base algorithm is named by the key ``base`` of the trainer section when the trainer is a wrapper, else of the
aggregator section (``--set trainer.base=fedrep``); a wrapping aggregator wraps that algorithm's aggregator and a
wrapping trainer its trainer. Everything that needs the classes -- config validation, simulation, ``fl show`` --
resolves them here, once:

- the section's valid keys are the base component's declared params, then the wrapper's (which win), plus
  ``base``;
- the base algorithm's defaults apply beneath the wrapping algorithm's own (core < base < wrapper < user);
- the protocol check compares the composed classes.

See docs/augmenting.md for a walk-through.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..api import registry as reg
from ..common.errors import ConfigError, PflError, did_you_mean
from ..api.params import Param, ParamSpec

BASE_KEY = "base"
SECTIONS = ("trainer", "aggregator")


def is_wrapper(component: Any) -> bool:
    """True for a trainer/aggregator class that augments a base algorithm's component (has ``wrap``)."""
    return isinstance(component, type) and callable(getattr(component, "wrap", None))


def _params(component: Any) -> ParamSpec:
    return dict(getattr(component, "params", None) or {})


def base_section(trainer: Any, aggregator: Any) -> Optional[str]:
    """The section whose ``base`` key names the base algorithm (None when nothing wraps)."""
    if is_wrapper(trainer):
        return "trainer"
    if is_wrapper(aggregator):
        return "aggregator"
    return None


def base_param(wrapper: Any) -> Param:
    default = getattr(wrapper, "default_base", None) or "fedavg"
    name = getattr(wrapper, "wrapper_name", None) or wrapper.__name__
    return Param(default, f"base algorithm that {name} augments (an algorithm name; fl show {name.lower()} "
                          f"lists the ones it can wrap)")


@dataclass(frozen=True)
class Composition:
    """The classes a run builds, and what they were composed from."""

    trainer: Any
    aggregator: Any
    base: Optional[str] = None            # the base algorithm's name, when a wrapper is involved
    section: Optional[str] = None         # the section holding ``base``
    base_trainer: Any = None
    base_aggregator: Any = None
    wraps: Tuple[str, ...] = ()           # the sections whose component is a wrapper

    @property
    def wrapped(self) -> bool:
        return self.base is not None


def _base_components(base: str) -> Tuple[Any, Any, Any]:
    algo = reg.ALGORITHMS.get(base)
    return algo, reg.TRAINERS.get(algo.trainer), reg.AGGREGATORS.get(algo.aggregator)


def _refusal(trainer: Any, aggregator: Any, base_trainer: Any, base_aggregator: Any) -> Optional[str]:
    """Why the wrappers among ``trainer``/``aggregator`` cannot wrap these base components, or None."""
    for wrapper, base_cls in ((trainer, base_trainer), (aggregator, base_aggregator)):
        if not is_wrapper(wrapper):
            continue
        if is_wrapper(base_cls):
            return "it is itself an augmenting algorithm"
        check = getattr(wrapper, "can_wrap", None)
        reason = check(base_cls) if callable(check) else None
        if reason:
            return reason
    return None


def allowed_bases(trainer: Any, aggregator: Any) -> List[str]:
    """Installed algorithms the wrappers can augment (loads every algorithm plugin; used for error messages)."""
    out = []
    for name in reg.ALGORITHMS.names():
        try:
            _, bt, ba = _base_components(name)
        except PflError:
            continue  # a plugin that fails to load is reported by 'fl list', not here
        if _refusal(trainer, aggregator, bt, ba) is None:
            out.append(name)
    return out


@lru_cache(maxsize=None)
def _wrap(wrapper: Any, base_cls: Any) -> Any:
    """One composed class per (wrapper, base) pair, so repeated resolution yields the identical class."""
    return wrapper.wrap(base_cls)


def compose(trainer: Any, aggregator: Any, base: Optional[str] = None) -> Composition:
    """Resolve registered trainer/aggregator objects (wrappers or not) into the classes to build.

    ``base`` names the base algorithm (None: the wrapper's ``default_base``). Raises a ConfigError naming the
    allowed bases when the base is unknown or cannot be wrapped.
    """
    section = base_section(trainer, aggregator)
    if section is None:
        return Composition(trainer, aggregator)
    wrapper = trainer if section == "trainer" else aggregator
    if base is None:
        base = base_param(wrapper).default
    key = f"{section}.{BASE_KEY}"
    if not isinstance(base, str):
        raise ConfigError(f"{key}: expected an algorithm name, got {base!r}")
    if base not in reg.ALGORITHMS.names():
        allowed = allowed_bases(trainer, aggregator)
        raise ConfigError(f"{key}: unknown algorithm '{base}'.{did_you_mean(base, allowed)} "
                          f"Bases {wrapper.__name__} can wrap: {', '.join(allowed) or '(none installed)'}")
    _, bt, ba = _base_components(base)
    reason = _refusal(trainer, aggregator, bt, ba)
    if reason:
        allowed = allowed_bases(trainer, aggregator)
        raise ConfigError(f"{key}: {wrapper.__name__} cannot wrap '{base}': {reason}. "
                          f"Bases it can wrap: {', '.join(allowed) or '(none installed)'}")
    t = _wrap(trainer, bt) if is_wrapper(trainer) else trainer
    a = _wrap(aggregator, ba) if is_wrapper(aggregator) else aggregator
    wraps = tuple(s for s, c in (("trainer", trainer), ("aggregator", aggregator)) if is_wrapper(c))
    return Composition(t, a, base, section, bt, ba, wraps)


def _names(cfg: Mapping[str, Any]) -> Tuple[str, str]:
    return cfg["trainer"]["name"], cfg["aggregator"]["name"]


def composition(cfg: Mapping[str, Any]) -> Composition:
    """The composition of a (merged or resolved) configuration: its trainer/aggregator names and ``base``."""
    t_name, a_name = _names(cfg)
    trainer, aggregator = reg.TRAINERS.get(t_name), reg.AGGREGATORS.get(a_name)
    section = base_section(trainer, aggregator)
    base = cfg[section].get(BASE_KEY) if section is not None and isinstance(cfg.get(section), Mapping) else None
    return compose(trainer, aggregator, base)


def section_params(section: str, component: Any, comp: Composition) -> ParamSpec:
    """The params a component section accepts: the base component's, then the wrapper's, plus ``base``."""
    if section not in comp.wraps or not is_wrapper(component):
        return _params(component)
    base_cls = comp.base_trainer if section == "trainer" else comp.base_aggregator
    spec = {**_params(base_cls), **_params(component)}
    if section == comp.section:
        spec[BASE_KEY] = base_param(component)
    return spec


def base_defaults(comp: Composition) -> Dict[str, Any]:
    """The base algorithm's default overlay, to be merged beneath the wrapping algorithm's own.

    Its trainer/aggregator *names* are dropped (the composed component keeps the wrapper's name); their other
    keys (e.g. FedRep's ``trainer.head_epochs``) stay for a section whose component wraps the base's, as do its
    model/train defaults.
    """
    if not comp.wrapped:
        return {}
    algo = reg.ALGORITHMS.get(comp.base)
    out = copy.deepcopy(dict(getattr(algo, "defaults", {}) or {}))
    for section in SECTIONS:
        if section not in comp.wraps:
            out.pop(section, None)
        elif isinstance(out.get(section), dict):
            out[section].pop("name", None)
            if not out[section]:
                out.pop(section)
    return out
