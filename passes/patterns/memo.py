"""Matches remembered by region structure: a region equal in structure to one matched before is not evaluated again.

The twelve layers of a model, and the train, accumulating, stacked and
diagnosed graphs, hold the same regions many times over. A region's
`signature` is its ops, attributes, wiring, leaf types, kinds and constants
without its place in the graph; a backward's key adds its forward's and
where each of its free leaves sits in the forward. A match is kept as a
recipe of positions in the region (`Region.refs`) and applied to each region
of that signature.
"""

from __future__ import annotations

from typing import Any

from attrs import define, field, frozen

from .families import Match, match_backward, match_forward
from .forms import read_forms
from .regions import Region

Ref = tuple[str, int]


@frozen
class Recipe:
    """A match by positions in its region."""

    family: str
    direction: str
    inputs: dict[str, Ref]
    outputs: dict[str, list[Ref]]
    params: dict[str, Any]
    slice: tuple[int, ...]
    stats: tuple[str, ...]
    accumulate: Ref | None
    forms: tuple[str, ...]
    refusal: str | None
    declined: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, match: Match) -> Recipe:
        refs = match.region.refs()
        index = {op: i for i, op in enumerate(match.region.ops)}
        return cls(match.family, match.direction, {r: refs[v] for r, v in match.inputs.items()},
                   {r: [refs[v] for v in values] for r, values in match.outputs.items()}, dict(match.params),
                   tuple(index[op] for op in match.slice), match.stats,
                   refs[match.accumulate] if match.accumulate is not None else None, tuple(match.forms),
                   match.refusal, match.declined)

    def apply(self, region: Region, forward: Match | None) -> Match:
        return Match(self.family, self.direction, region, {r: region.at(ref) for r, ref in self.inputs.items()},
                     {r: [region.at(ref) for ref in refs] for r, refs in self.outputs.items()}, dict(self.params),
                     [region.ops[i] for i in self.slice], forward=forward, stats=self.stats,
                     accumulate=region.at(self.accumulate) if self.accumulate is not None else None,
                     forms=list(self.forms), refusal=self.refusal,
                     declined=self.declined)


@define(eq=False)
class MatchCache:
    """Forward and backward matches by structure, for one run of the pass."""

    recipes: dict[tuple, Recipe | None] = field(factory=dict)
    keys: dict[Match, tuple] = field(factory=dict)
    #: Attention confirmations by the structure of their ops (`attention.signature`).
    attention: dict[tuple, Any] = field(factory=dict)

    def forward(self, region: Region) -> Match | None:
        key = ("forward", region.signature())
        if key not in self.recipes:
            match = match_forward(region)
            if match is not None:
                match.forms = read_forms(match)
            self.recipes[key] = Recipe.of(match) if match is not None else None
        else:
            recipe = self.recipes[key]
            match = recipe.apply(region, None) if recipe is not None else None
        if match is not None:
            self.keys[match] = key
        return match

    def backward(self, region: Region, forward: Match) -> Match | None:
        refs = forward.region.refs()
        key = ("backward", region.signature(), self.keys[forward], tuple(refs.get(v) for v in region.leaves))
        if key not in self.recipes:
            match = match_backward(region, forward)
            self.recipes[key] = Recipe.of(match) if match is not None else None
            return match
        recipe = self.recipes[key]
        return recipe.apply(region, forward) if recipe is not None else None
