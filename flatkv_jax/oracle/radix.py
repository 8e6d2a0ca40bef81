"""The oracle's prefix index: a token trie per namespace whose nodes hold block pages.

The key of block ``i`` of group ``g`` is ``(namespace, tokens[0 : (i + 1) * B_g])``; it lives at
the trie node of depth ``(i + 1) * B_g`` on the path of those tokens, in ``node.pages[g]``.
This is a radix tree with one token per edge (no path compression): deliberately the
simplest structure that is obviously right, with no hashing and so no collisions. Nodes
that hold no page and have no children are pruned when an entry is removed.
"""

from __future__ import annotations

from collections.abc import Sequence


class Node:
    """One token prefix of one namespace.

    Attributes:
      parent: the node one token shorter (``None`` for a namespace root).
      token: the last token of the prefix (-1 for a root).
      depth: the prefix length in tokens.
      children: next token -> node.
      pages: group index -> page id of the block whose key is this prefix.
    """

    __slots__ = ("children", "depth", "pages", "parent", "token")

    def __init__(self, parent: Node | None, token: int, depth: int):
        self.parent = parent
        self.token = token
        self.depth = depth
        self.children: dict[int, Node] = {}
        self.pages: dict[int, int] = {}


class RadixIndex:
    """Token tries, one per namespace."""

    def __init__(self):
        self.roots: dict[int, Node] = {}

    def path(self, namespace: int, tokens: Sequence[int], length: int) -> list[Node | None]:
        """Nodes of the prefixes of ``tokens`` of depth ``0 .. length``; ``None`` past the trie."""
        node = self.roots.get(namespace)
        out: list[Node | None] = [node]
        for d in range(length):
            node = None if node is None else node.children.get(int(tokens[d]))
            out.append(node)
        return out

    def node(self, namespace: int, tokens: Sequence[int], depth: int) -> Node:
        """The node of prefix ``tokens[:depth]``, creating the path as needed."""
        node = self.roots.get(namespace)
        if node is None:
            node = self.roots[namespace] = Node(None, -1, 0)
        for d in range(depth):
            t = int(tokens[d])
            child = node.children.get(t)
            if child is None:
                child = node.children[t] = Node(node, t, d + 1)
            node = child
        return node

    def remove(self, node: Node, group: int) -> None:
        """Drops ``node.pages[group]`` and prunes nodes left empty."""
        del node.pages[group]
        while node.parent is not None and not node.pages and not node.children:
            del node.parent.children[node.token]
            node = node.parent

    def clear(self) -> None:
        self.roots.clear()

    def entries(self) -> list[tuple[Node, int, int]]:
        """Every ``(node, group, page)`` entry (for invariant checks)."""
        out, stack = [], list(self.roots.values())
        while stack:
            node = stack.pop()
            out.extend((node, g, p) for g, p in node.pages.items())
            stack.extend(node.children.values())
        return out
