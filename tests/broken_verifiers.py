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


def topk_accepting_walk(tree, logits, sampler, position):
    """Sampling walk that accepts a drafted child whenever its token is inside the processed
    top-k (nonzero probability) instead of drawing: the common wrong shortcut."""
    children, accepted, draws, row = tree.children(), [], {}, 0
    while True:
        probs = sampler.probabilities(logits[row][None])[0]
        hit = next((child for token, child in children[row].items() if probs[token] > 0), None)
        if hit is None:
            draws[row] = sampler.token(logits[row], position + len(accepted))
            return accepted, draws
        draws[row] = int(tree.tokens[hit])
        accepted.append(hit)
        row = hit + 1


def retry_once_walk(tree, logits, sampler, position):
    """Sampling walk that, when a draw misses every child, draws once more before committing:
    a subtle bias toward drafted tokens."""
    children, accepted, draws, row = tree.children(), [], {}, 0
    while True:
        index = position + len(accepted)
        token = sampler.token(logits[row], index)
        if token not in children[row] and children[row]:
            again = float(sampler.uniforms[min(index, len(sampler.uniforms) - 1)] * 7919.0 % 1.0)  # another uniform
            token = sampler.token_at(logits[row], again)
        draws[row] = token
        child = children[row].get(token)
        if child is None:
            return accepted, draws
        accepted.append(child)
        row = child + 1
