"""What discovery finds: a stack of blocks and each block's children, by FQN and holding no module, so a plan file keeps
them (``LayerStack.to_dict``) and re-planning reads them back without the model and without torch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, astuple, dataclass
from typing import Any

__all__ = ["Block", "Child", "LayerStack"]


@dataclass(frozen=True)
class Child:
    """A direct child of a block: the unit that ``selective`` plans checkpoint."""

    name: str
    class_name: str
    kind: str  # "attention" | "mlp" | "norm" | "other"
    num_params: int


@dataclass(frozen=True)
class Block:
    """One layer of a stack, addressed by its fully qualified name in the (uncompiled) model."""

    fqn: str
    index: int
    class_name: str
    num_params: int
    children: tuple[Child, ...]

    def children_of_kind(self, kind: str) -> tuple[str, ...]:
        return tuple(c.name for c in self.children if c.kind == kind)


@dataclass(frozen=True)
class LayerStack:
    """A container whose children are the blocks, executed in order by the parent's forward."""

    fqn: str
    container_class: str
    blocks: tuple[Block, ...]

    @property
    def num_params(self) -> int:
        return sum(b.num_params for b in self.blocks)

    @property
    def block_fqns(self) -> tuple[str, ...]:
        return tuple(b.fqn for b in self.blocks)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (``from_dict`` reads it back): what a plan file keeps to re-plan without the model."""
        return {
            "fqn": self.fqn,
            "container_class": self.container_class,
            "blocks": [{**asdict(b), "children": [list(astuple(c)) for c in b.children]} for b in self.blocks],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LayerStack:
        blocks = []
        for b in data["blocks"]:
            children = tuple(Child(*c) for c in b["children"])
            blocks.append(Block(b["fqn"], int(b["index"]), b["class_name"], int(b["num_params"]), children))
        return cls(data["fqn"], data["container_class"], tuple(blocks))
