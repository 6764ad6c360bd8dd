-- agentrun schema, version 10: prompt-cache tokens, summed like input_tokens and output_tokens
-- (migration 3) by the fenced append of each model turn, in the same statement. The API bills
-- them apart from input tokens (a cache write at 1.25x, a read at 0.1x the input price), so the
-- run's cost needs all four. Each step keeps its own figures in its payload's usage, as the
-- provider reported them. Not indexed, so an append stays a HOT update.
ALTER TABLE agent_run
    ADD COLUMN cache_read_tokens  bigint NOT NULL DEFAULT 0,
    ADD COLUMN cache_write_tokens bigint NOT NULL DEFAULT 0;
