"""Beam search on the paged cache: beams are forks that share blocks; HF-identical selection."""

from __future__ import annotations

from collections.abc import Callable

import torch

from octavo.engine.core.beam_state import NEG_INF_SCORE, BeamState, length_normalizer
from octavo.engine.core.block_manager import BlockManager
from octavo.engine.core.sequence import Sequence, SequenceGroup, SequenceStatus
from octavo.engine.core_messages import BeamResult
from octavo.engine.step_io import BeamCandidates, BeamChoice


class BeamSearch:
    """Applies one step of beam search to a group given each live beam's next-token log-probs.

    Follows transformers' `_beam_search` step for step: accumulated scores over all beams,
    top candidates, candidates ending in a stop token (or at max length) among the first
    beam_width become hypotheses, the best others continue. A continuing beam whose parent
    is another beam is a BlockManager fork of the parent (tables copied, nothing moved);
    parents nobody continues are freed. A beam_width of 1 is greedy decoding, as in HF.

    For the scheduler it also plans the live beams' tokens of a step (`plan`, with a
    recomputed prompt shared: `share_prompt`) and keeps which beams of constrained searches
    the worker holds a grammar state of (`announce`, `follow`, `forget`).
    """

    def __init__(self, block_manager: BlockManager, new_seq_id: Callable[[], int]):
        self.block_manager = block_manager
        self.new_seq_id = new_seq_id
        # Beams of constrained searches the worker keeps a grammar state of; the first beams
        # announced and the beams chosen since the scheduler last took them (its next step's
        # SchedulerOutput.new_constrained_beams and beam_choices).
        self.constrained_beams: set[int] = set()
        self.new_constrained_beams: dict[int, str] = {}
        self.beam_choices: list[BeamChoice] = []

    @staticmethod
    def plan(group: SequenceGroup, budget: int) -> list[tuple[Sequence, int]]:
        """The tokens each live beam computes this step (at most `budget` in all): live beams
        decode together, so one step ranks candidates across all of them.

        After a preemption they are recomputed sharing the prompt again: the first beam
        computes the prompt, the others fork it at the prompt's end (`share_prompt`), then
        each computes its own tokens but the last, which all beams compute in one decode step.
        """
        beams = group.unfinished_seqs
        if all(b.num_uncomputed_tokens == 1 for b in beams):
            return [(b, 1) for b in beams] if budget >= len(beams) else []
        first, prompt_len = beams[0], len(group.prompt_token_ids)
        if first.num_computed_tokens < prompt_len:
            return [(first, min(prompt_len - first.num_computed_tokens, budget))]
        plan = []
        for beam in beams:
            num_new = min(beam.num_uncomputed_tokens - 1, budget)
            if num_new > 0:
                plan.append((beam, num_new))
                budget -= num_new
        return plan

    def share_prompt(self, group: SequenceGroup, first: Sequence) -> None:
        """The other beams of a recomputed group take the prompt blocks `first` is filling."""
        for beam in group.unfinished_seqs:
            if beam is not first and beam.num_computed_tokens == 0:
                self.block_manager.fork(first, beam)
                beam.num_computed_tokens = len(group.prompt_token_ids)

    def announce(self, seq: Sequence, grammar: str) -> None:
        """The first beam of a constrained search, scheduled: the worker starts its grammar
        state (the others are forks, announced as `BeamChoice`s)."""
        if seq.seq_id not in self.constrained_beams:
            self.constrained_beams.add(seq.seq_id)
            self.new_constrained_beams[seq.seq_id] = grammar

    def follow(self, group: SequenceGroup, before: list[Sequence]) -> list[int]:
        """After a constrained search's step from the beams `before`: tells the worker which
        beams it goes on with (each from its parent's grammar state); returns those it
        dropped (pruned, or all at its end), whose states the worker forgets."""
        state = group.beam
        assert state is not None
        live = set()
        if not group.is_finished:
            for seq_id, parent_seq_id, token_id in state.last_choices:
                self.beam_choices.append(BeamChoice(seq_id, parent_seq_id, token_id))
                self.constrained_beams.add(seq_id)
                live.add(seq_id)
        dropped = {b.seq_id for b in before} | {c[0] for c in state.last_choices}
        return [seq_id for seq_id in dropped - live if self.forget(seq_id)]

    def forget(self, seq_id: int) -> bool:
        """Stops following a beam; whether the worker kept a grammar state of it."""
        followed = seq_id in self.constrained_beams
        self.constrained_beams.discard(seq_id)
        return followed

    def step(self, group: SequenceGroup, candidates: BeamCandidates) -> None:
        """candidates: each live beam's best next tokens, at least `candidates_needed` of them
        (or the whole vocabulary), rows in the order of the group's unfinished beams."""
        state = group.beam
        assert state is not None
        beams = group.unfinished_seqs
        generated = beams[0].num_output_tokens
        logprobs, token_ids = candidates.logprobs, candidates.token_ids
        if generated < state.params.min_tokens and state.stop_token_ids:
            stops = torch.isin(token_ids, torch.tensor(state.stop_token_ids))
            logprobs = logprobs.masked_fill(stops, float("-inf"))
        if state.params.beam_width == 1:
            best = int(logprobs[0].argmax())
            self._greedy_step(
                group, state, beams[0], int(token_ids[0, best]), logprobs[0, best], generated
            )
            return
        width = state.params.beam_width
        per_beam = logprobs.shape[1]
        scores = (logprobs + state.running_scores[:, None]).reshape(-1)
        top_scores, top_index = scores.topk(state.candidates_per_step)
        parents = (top_index // per_beam).tolist()
        tokens = token_ids.reshape(-1)[top_index].tolist()
        token_logprobs = logprobs.reshape(-1)[top_index]
        at_max_len = generated + 1 >= state.max_new_tokens
        hits = torch.tensor([at_max_len or t in state.stop_token_ids for t in tokens])

        running = top_scores + hits.float() * NEG_INF_SCORE
        next_index = running.topk(width).indices.tolist()
        self._finish_candidates(state, beams, parents, tokens, top_scores, hits, generated)
        state.running_scores = running[next_index]
        self._advance(
            group,
            state,
            beams,
            [(parents[i], tokens[i], token_logprobs[i]) for i in next_index],
        )
        if self._is_done(state, generated + 1, bool(hits.all())):
            self._finish_group(group)

    def _greedy_step(
        self,
        group: SequenceGroup,
        state: BeamState,
        beam: Sequence,
        token: int,
        logprob: torch.Tensor,
        generated: int,
    ) -> None:
        state.running_scores = state.running_scores + logprob
        beam.append_token(token, float(logprob))
        state.last_choices = [(beam.seq_id, beam.seq_id, token)]
        stopped = token in state.stop_token_ids
        if stopped or generated + 1 >= state.max_new_tokens:
            length = generated + 1
            score = float(
                state.running_scores[0] / length_normalizer(length, state.params.length_penalty)
            )
            state.slots[0] = BeamResult(
                beam.output_token_ids,
                float(state.running_scores[0]),
                score,
                "stop" if stopped else "length",
            )
            self._finish_group(group)

    def _finish_candidates(
        self,
        state: BeamState,
        beams: list[Sequence],
        parents: list[int],
        tokens: list[int],
        top_scores: torch.Tensor,
        hits: torch.Tensor,
        generated: int,
    ) -> None:
        """Merges the stopped candidates among the first beam_width into the best slots."""
        width = state.params.beam_width
        just_finished = hits.clone()
        just_finished[width:] = False
        if not bool(just_finished.any()):
            return
        length = generated + 1
        normalized = top_scores / length_normalizer(length, state.params.length_penalty)
        normalized = normalized + (~just_finished).float() * NEG_INF_SCORE
        merged = torch.cat((state.slot_scores, normalized))
        keep = merged.topk(width).indices.tolist()
        new_slots = []
        for index in keep:
            if index < width:
                new_slots.append(state.slots[index])
                continue
            i = index - width
            if not bool(just_finished[i]):
                new_slots.append(None)  # a -1e9 filler, exactly as HF keeps one
                continue
            parent = beams[parents[i]]
            stopped = tokens[i] in state.stop_token_ids
            new_slots.append(
                BeamResult(
                    parent.output_token_ids + [tokens[i]],
                    float(top_scores[i]),
                    float(normalized[i]),
                    "stop" if stopped else "length",
                )
            )
        state.slots = new_slots
        state.slot_scores = merged[keep]

    def _advance(
        self,
        group: SequenceGroup,
        state: BeamState,
        beams: list[Sequence],
        chosen: list[tuple[int, int, torch.Tensor]],
    ) -> None:
        """Makes the chosen (parent, token) pairs the live beams, forking and freeing blocks."""
        used: set[int] = set()
        next_beams: list[Sequence] = []
        for parent_index, _, _ in chosen:
            parent = beams[parent_index]
            if parent_index in used:  # another child of this parent: share its blocks
                child = parent.fork(self.new_seq_id(), parent.index)
                self.block_manager.fork(parent, child)
                next_beams.append(child)
            else:
                used.add(parent_index)
                next_beams.append(parent)
        # Forks copied their parents' tokens above; now every beam gets its own new token.
        state.last_choices = []
        for beam, (parent_index, token, logprob) in zip(next_beams, chosen, strict=True):
            beam.append_token(token, float(logprob))
            state.last_choices.append((beam.seq_id, beams[parent_index].seq_id, token))
        for index, beam in enumerate(beams):
            if index not in used:  # pruned: nobody continues it
                beam.status = SequenceStatus.FINISHED_STOPPED
                self.block_manager.free(beam)
        group.seqs = next_beams

    @staticmethod
    def _is_done(state: BeamState, generated: int, all_hit: bool) -> bool:
        """HF's stopping rule after a step (`generated` tokens now in every beam)."""
        params = state.params
        if params.early_stopping == "never" and params.length_penalty > 0.0:
            length = state.max_new_tokens
        else:
            length = generated
        best_running = state.running_scores[0] / length_normalizer(length, params.length_penalty)
        full = all(slot is not None for slot in state.slots)
        worst = state.slot_scores.min() if full else torch.tensor(NEG_INF_SCORE)
        state.heuristic_unsatisfied = state.heuristic_unsatisfied and bool(best_running > worst)
        all_finished_early = full and params.early_stopping is True
        return not state.heuristic_unsatisfied or all_finished_early or all_hit

    def _finish_group(self, group: SequenceGroup) -> None:
        for beam in group.unfinished_seqs:
            beam.status = SequenceStatus.FINISHED_STOPPED
            self.block_manager.free(beam)
