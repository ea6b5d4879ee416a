"""A naive, loop-based float64 reference of docs/design.md: §1 causal steps, §3 block mode, §5 coreset.

Written line by line from `docs/design.md`, one sequence and one token at a time, with no
code shared with the implementation under test (only the parameter pytree it reads).
It also records the smallest margin of every discrete decision it takes (top-k routing
boundaries and the coreset cut), so tests can check their inputs are far from ties.
"""

from __future__ import annotations

import math

import numpy as np


def silu(x):
    return x / (1.0 + np.exp(-x))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x):
    return np.log1p(np.exp(x))


def softmax(x):
    e = np.exp(x - np.max(x))
    return e / e.sum()


def rms(x, eps):
    return x / np.sqrt(np.mean(x * x) + eps)


def l2norm(x):
    return x / np.sqrt(np.sum(x * x) + 1e-6)


class NaiveClover:
    def __init__(self, config, params, right_branch: bool = True):
        self.c = config
        self.p = _to_float64(params)
        self.right_branch = right_branch
        self.min_margin = np.inf

    # ---------------------------------------------------------------- parameters
    def layer(self, index):
        c = self.c
        group, slot = divmod(index, len(c.group_pattern))
        node = self.p["groups"][f"layer_{slot}"]
        return _select(node, group)

    def head(self):
        return self.p["embed_tokens"]["embedding"] if self.c.tie_word_embeddings else self.p["lm_head"]

    # ---------------------------------------------------------------- building blocks
    def norm(self, x, weight):
        return rms(x, self.c.rms_norm_eps) * (1.0 + weight)

    def rope(self, x, position):
        """x: [head_dim]; rotate the first rotary_dim dims (rotate_half layout)."""
        d = self.c.rotary_dim
        out = x.copy()
        half = d // 2
        for i in range(half):
            frequency = 1.0 / (self.c.rope_theta ** (2 * i / d))
            angle = position * frequency
            a, b = x[i], x[i + half]
            out[i] = a * math.cos(angle) - b * math.sin(angle)
            out[i + half] = b * math.cos(angle) + a * math.sin(angle)
        return out

    def top_k(self, probabilities, k, allowed=None):
        """Indices of the k largest allowed entries, ties to the lower index, and their margin."""
        candidates = [e for e in range(len(probabilities)) if allowed is None or allowed[e]]
        ranked = sorted(candidates, key=lambda e: (-probabilities[e], e))
        chosen = ranked[:k]
        if len(ranked) > k:
            self.min_margin = min(self.min_margin, probabilities[ranked[k - 1]] - probabilities[ranked[k]])
        return chosen

    def expert(self, mlp, e, x):
        intermediate = self.c.moe_intermediate_size
        gate_up = mlp["experts_gate_up_proj"][e]  # [2I, hidden], gate rows first
        gate, up = gate_up[:intermediate] @ x, gate_up[intermediate:] @ x
        return mlp["experts_down_proj"][e] @ (silu(gate) * up)

    def shared(self, mlp, x):
        s = mlp["shared_expert"]
        inner = silu(s["gate_proj"]["weight"] @ x) * (s["up_proj"]["weight"] @ x)
        return sigmoid(mlp["shared_expert_gate"]["weight"] @ x)[0] * (s["down_proj"]["weight"] @ inner)

    def moe(self, mlp, rows, coreset_top_p=None):
        """rows: list of [hidden]; plain top-k, or within the block's coreset (docs/design.md §5)."""
        k = self.c.num_experts_per_tok
        probabilities = [softmax(mlp["gate"] @ x) for x in rows]
        allowed = None
        if coreset_top_p is not None:
            aggregate = np.zeros(self.c.num_experts)
            for p in probabilities:
                for e in self.top_k(p, k):
                    aggregate[e] += p[e]
            order = sorted(range(self.c.num_experts), key=lambda e: (-aggregate[e], e))
            total, kept, allowed = aggregate.sum(), 0.0, np.zeros(self.c.num_experts, bool)
            for e in order:
                if aggregate[e] <= 0 or (kept >= coreset_top_p * total and coreset_top_p < 1):
                    break
                allowed[e] = True
                kept += aggregate[e]
            if coreset_top_p < 1:
                before_last = kept - aggregate[order[int(allowed.sum()) - 1]]
                self.min_margin = min(self.min_margin, abs(kept - coreset_top_p * total),
                                      abs(before_last - coreset_top_p * total))
        outputs, used = [], set()
        for x, p in zip(rows, probabilities, strict=True):
            chosen = self.top_k(p, k, allowed)
            weights = np.array([p[e] for e in chosen])
            weights = weights / weights.sum()
            used.update(chosen)
            routed = sum(w * self.expert(mlp, e, x) for w, e in zip(weights, chosen, strict=True))
            outputs.append(routed + self.shared(mlp, x))
        return outputs, len(used)

    def gated_norm(self, linear, o, z):
        c = self.c
        heads = [linear["norm"]["weight"] * rms(o[h], c.rms_norm_eps) * silu(z[h])
                 for h in range(c.linear_num_value_heads)]
        return linear["out_proj"]["weight"] @ np.concatenate(heads)

    def split_qkv(self, activated):
        c = self.c
        q = activated[:c.linear_key_dim].reshape(c.linear_num_key_heads, c.linear_key_head_dim)
        k = activated[c.linear_key_dim:2 * c.linear_key_dim].reshape(c.linear_num_key_heads, c.linear_key_head_dim)
        v = activated[2 * c.linear_key_dim:].reshape(c.linear_num_value_heads, c.linear_value_head_dim)
        return q, k, v

    def key_head(self, value_head):
        return value_head // (self.c.linear_num_value_heads // self.c.linear_num_key_heads)

    # ---------------------------------------------------------------- causal mode (§1), one token
    def new_state(self):
        c = self.c
        state = []
        for layer_type in c.layer_types:
            if layer_type == "linear_attention":
                state.append({"rows": [np.zeros(c.conv_dim)] * (c.linear_conv_kernel_dim - 1),
                              "S": np.zeros((c.linear_num_value_heads, c.linear_key_head_dim,
                                             c.linear_value_head_dim))})
            else:
                state.append({"keys": [], "values": []})
        return state

    def causal_step(self, state, token, position):
        """Advance `state` by one token; returns the token's logits."""
        c = self.c
        x = self.p["embed_tokens"]["embedding"][token].copy()
        for index, layer_type in enumerate(c.layer_types):
            lp, st = self.layer(index), state[index]
            h = self.norm(x, lp["input_layernorm"]["weight"])
            if layer_type == "linear_attention":
                la = lp["linear_attn"]
                mixed = la["in_proj_qkv"]["weight"] @ h
                st["rows"] = st["rows"] + [mixed]
                window = st["rows"][-c.linear_conv_kernel_dim:]
                conv = sum(la["conv1d_weight"][:, j] * window[j] for j in range(c.linear_conv_kernel_dim))
                st["rows"] = st["rows"][-(c.linear_conv_kernel_dim - 1):]
                q, k, v = self.split_qkv(silu(conv))
                beta = sigmoid(la["in_proj_b"]["weight"] @ h)
                g = -np.exp(la["A_log"]) * softplus(la["in_proj_a"]["weight"] @ h + la["dt_bias"])
                z = (la["in_proj_z"]["weight"] @ h).reshape(c.linear_num_value_heads, -1)
                o = np.zeros((c.linear_num_value_heads, c.linear_value_head_dim))
                for head in range(c.linear_num_value_heads):
                    qh = l2norm(q[self.key_head(head)]) / math.sqrt(c.linear_key_head_dim)
                    kh = l2norm(k[self.key_head(head)])
                    S = st["S"][head] * math.exp(g[head])
                    S = S + np.outer(kh, beta[head] * (v[head] - S.T @ kh))
                    st["S"][head] = S
                    o[head] = S.T @ qh
                mixed_out = self.gated_norm(la, o, z)
            else:
                queries, gates, key, value = self.attention_projections(lp["self_attn"], h, position)
                st["keys"].append(key)
                st["values"].append(value)
                mixed_out = self.attend(lp["self_attn"], queries, gates, st["keys"], st["values"])
            x = x + mixed_out
            outputs, _ = self.moe(lp["mlp"], [self.norm(x, lp["post_attention_layernorm"]["weight"])])
            x = x + outputs[0]
        return self.head() @ self.norm(x, self.p["norm"]["weight"])

    def attention_projections(self, attn, h, position):
        c = self.c
        qg = (attn["q_proj"]["weight"] @ h).reshape(c.num_attention_heads, 2 * c.head_dim)
        queries = [self.rope(self.norm(qg[i, :c.head_dim], attn["q_norm"]["weight"]), position)
                   for i in range(c.num_attention_heads)]
        gates = [qg[i, c.head_dim:] for i in range(c.num_attention_heads)]
        k = (attn["k_proj"]["weight"] @ h).reshape(c.num_key_value_heads, c.head_dim)
        v = (attn["v_proj"]["weight"] @ h).reshape(c.num_key_value_heads, c.head_dim)
        key = [self.rope(self.norm(k[j], attn["k_norm"]["weight"]), position) for j in range(c.num_key_value_heads)]
        return queries, gates, key, [v[j] for j in range(c.num_key_value_heads)]

    def attend(self, attn, queries, gates, keys, values):
        c = self.c
        group = c.num_attention_heads // c.num_key_value_heads
        heads = []
        for i, (q, gate) in enumerate(zip(queries, gates, strict=True)):
            j = i // group
            scores = np.array([q @ key[j] for key in keys]) / math.sqrt(c.head_dim)
            weights = softmax(scores)
            heads.append(sum(w * value[j] for w, value in zip(weights, values, strict=True)) * sigmoid(gate))
        return attn["o_proj"]["weight"] @ np.concatenate(heads)

    # ---------------------------------------------------------------- block mode (§3)
    def prefill(self, tokens):
        state = self.new_state()
        for position, token in enumerate(tokens):
            self.causal_step(state, token, position)
        return state

    def denoise(self, state, block, start, coreset_top_p=None):
        """Logits [B, vocab] of `block` at positions start..start+B-1; `state` is not changed.

        Returns (logits, distinct experts per layer)."""
        c = self.c
        xs = [self.p["embed_tokens"]["embedding"][t].copy() for t in block]
        distinct = []
        for index, layer_type in enumerate(c.layer_types):
            lp, st = self.layer(index), state[index]
            hs = [self.norm(x, lp["input_layernorm"]["weight"]) for x in xs]
            if layer_type == "linear_attention":
                outs = self.gdn_block(lp["linear_attn"], st, hs)
            else:
                attn = lp["self_attn"]
                projected = [self.attention_projections(attn, h, start + i) for i, h in enumerate(hs)]
                keys = st["keys"] + [p[2] for p in projected]
                values = st["values"] + [p[3] for p in projected]
                outs = [self.attend(attn, p[0], p[1], keys, values) for p in projected]
            xs = [x + o for x, o in zip(xs, outs, strict=True)]
            normed = [self.norm(x, lp["post_attention_layernorm"]["weight"]) for x in xs]
            outputs, used = self.moe(lp["mlp"], normed, coreset_top_p)
            distinct.append(used)
            xs = [x + o for x, o in zip(xs, outputs, strict=True)]
        logits = np.stack([self.head() @ self.norm(x, self.p["norm"]["weight"]) for x in xs])
        return logits, distinct

    def gdn_block(self, la, st, hs):
        c = self.c
        size, kernel = len(hs), c.linear_conv_kernel_dim
        rows = [la["in_proj_qkv"]["weight"] @ h for h in hs]
        window = st["rows"] + rows  # the conv state, then the block
        w_right = la["conv1d_right_weight"]
        heads, dk = c.linear_num_value_heads, c.linear_key_head_dim
        qs, ks, vs = [], [], []
        for i in range(size):
            causal = sum(la["conv1d_weight"][:, j] * window[i + j] for j in range(kernel))
            right = np.zeros(c.conv_dim)
            if self.right_branch:
                for t in range(kernel):
                    if i + 1 + t < size:
                        right = right + w_right[:, t] * rows[i + 1 + t]
            q, k, v = self.split_qkv(silu(causal + right))
            qs.append([l2norm(q[self.key_head(h)]) for h in range(heads)])
            ks.append([l2norm(k[self.key_head(h)]) for h in range(heads)])
            vs.append(v)
        outs = []
        for i in range(size):
            z = (la["in_proj_z"]["weight"] @ hs[i]).reshape(heads, -1)
            o = np.zeros((heads, c.linear_value_head_dim))
            for h in range(heads):
                memory = st["S"][h].T @ (qs[i][h] / math.sqrt(dk))
                logits = [math.exp(la["block_logit_scale"][h]) * (qs[i][h] @ ks[j][h]) for j in range(size)]
                mu = la["memory_logit_bias"][h] + la["block_size_calibration"][h] * math.log(size)
                peak = max(mu, max(logits))
                numerator = math.exp(mu - peak) * memory + sum(
                    math.exp(logit - peak) * vs[j][h] for j, logit in enumerate(logits))
                denominator = math.exp(mu - peak) + sum(math.exp(logit - peak) for logit in logits)
                o[h] = numerator / denominator
            outs.append(self.gated_norm(la, o, z))
        return outs


def _to_float64(tree):
    if isinstance(tree, dict):
        return {k: _to_float64(v) for k, v in tree.items()}
    return np.asarray(tree, dtype=np.float64)


def _select(tree, index):
    if isinstance(tree, dict):
        return {k: _select(v, index) for k, v in tree.items()}
    return tree[index]
