"""Deliberately wrong verification pieces for negative controls: a check that passes with
one of these patched in cannot detect what it claims to."""


def first_child_walk(tree, argmax):
    """An acceptance walk that follows the first child whatever the target's argmax says."""
    path, position = [], 0
    while True:
        children = [i for i in range(len(tree)) if tree.parents[i] + 1 == position]
        if not children:
            return path
        path.append(children[0])
        position = children[0] + 1
