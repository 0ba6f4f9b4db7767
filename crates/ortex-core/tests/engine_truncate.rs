//! `Engine::truncate`: dropping the tail of a request's context between turns (what a full-duplex
//! session does when the client confirms it played only part of a response).

mod common;

use common::*;
use ortex_core::{Engine, ErrorCode, RequestId, RequestOptions, RunStart, TurnId, EVENT_STRIDE_WORDS};

const BLOCK_SIZE: u32 = 4;

fn engine(seed: u64) -> Engine {
    sim(&format!(r#"{{"seed":{seed},"blockSize":{BLOCK_SIZE},"numBlocks":64,"maxLength":256}}"#))
}

fn req(engine: &mut Engine) -> RequestId {
    engine.create_request(&RequestOptions::default()).unwrap()
}

fn code<T: std::fmt::Debug>(result: ortex_core::Result<T>) -> ErrorCode {
    result.expect_err("call should be refused").code
}

fn held_blocks(engine: &Engine) -> u32 {
    let stats = engine.stats();
    stats.total_blocks - stats.free_blocks
}

/// One turn of `max` tokens on `input`, run to the end; returns its tokens.
fn respond(engine: &mut Engine, r: RequestId, input: &[i32], max: u32) -> (TurnId, Vec<i32>) {
    let options = turn_opts(&format!(r#"{{"maxGeneratedTokens":{max}}}"#));
    let turn = engine.begin_turn(r, input, &options).unwrap();
    let events = run_all(engine, 8);
    (turn, tokens_of(&events, r, turn))
}

#[test]
fn truncate_drops_tokens_and_frees_the_blocks_past_them() {
    let mut e = engine(1);
    let r = req(&mut e);
    let (_, generated) = respond(&mut e, r, &[5; 10], 12);
    assert_eq!(generated.len(), 12);
    // 22 tokens, the last sampled one not yet in the KV: 21 computed -> 6 blocks of 4.
    assert_eq!(e.token_count(r).unwrap(), 22);
    assert_eq!(held_blocks(&e), 6);
    e.truncate(r, 13).unwrap();
    e.check_invariants();
    assert_eq!(e.token_count(r).unwrap(), 13);
    assert_eq!(held_blocks(&e), 4, "13 computed tokens need 4 blocks");
    assert_eq!(e.request_tokens(r).unwrap()[10..], generated[..3]);
    e.truncate(r, 13).unwrap();
    assert_eq!(held_blocks(&e), 4, "truncating to the current length changes nothing");
    e.truncate(r, 0).unwrap();
    e.check_invariants();
    assert_eq!((e.token_count(r).unwrap(), held_blocks(&e)), (0, 0));
}

#[test]
fn a_turn_after_truncation_continues_from_the_shorter_context() {
    let mut e = engine(2);
    let r = req(&mut e);
    let (_, generated) = respond(&mut e, r, &[7, 8, 9, 10, 11], 9);
    e.truncate(r, 5 + 3).unwrap();
    let (_, after) = respond(&mut e, r, &[12, 13], 6);
    e.check_invariants();

    // The same context built directly: prompt + the 3 kept tokens + the new input.
    let mut fresh = engine(2);
    let f = req(&mut fresh);
    let mut context = vec![7, 8, 9, 10, 11];
    context.extend_from_slice(&generated[..3]);
    context.extend_from_slice(&[12, 13]);
    let (_, expected) = respond(&mut fresh, f, &context, 6);
    assert_eq!(after, expected, "the truncated tail left no trace in the KV");
}

#[test]
fn truncate_shrinks_a_pending_prefill() {
    let mut e = engine(3);
    let r = req(&mut e);
    e.prefill(r, &[20; 8]).unwrap();
    run_all(&mut e, 4);
    e.prefill(r, &[21; 6]).unwrap();
    assert!(e.has_pending_work());
    // Cut inside the pending part: 2 of its 6 tokens stay pending.
    e.truncate(r, 10).unwrap();
    e.check_invariants();
    assert!(e.has_pending_work());
    assert_eq!(e.stats().prompt_tokens, 8);
    run_all(&mut e, 4);
    assert_eq!(e.stats().prompt_tokens, 10, "only what is left of the prefill is computed");
    // Cut below everything pending: nothing is left to compute.
    e.prefill(r, &[22; 3]).unwrap();
    e.truncate(r, 9).unwrap();
    assert!(!e.has_pending_work());
    assert_eq!(held_blocks(&e), 3);
    e.check_invariants();
}

#[test]
fn truncate_is_refused_while_a_turn_runs_and_for_bad_arguments() {
    let mut e = engine(4);
    let r = req(&mut e);
    let turn = e.begin_turn(r, &[5, 6], &turn_opts(r#"{"maxGeneratedTokens":4}"#)).unwrap();
    assert_eq!(code(e.truncate(r, 1)), ErrorCode::TurnActive);
    run(&mut e, 8);
    assert_eq!(code(e.truncate(r, 1)), ErrorCode::TurnActive, "active after its first token");
    assert!(e.cancel_turn(r, turn).unwrap());
    run_all(&mut e, 8);
    let count = e.token_count(r).unwrap();
    assert_eq!(code(e.truncate(r, count + 1)), ErrorCode::InvalidArgument);
    assert_eq!(code(e.truncate(RequestId(99), 0)), ErrorCode::InvalidArgument);
    e.truncate(r, 2).unwrap();
    e.close_request(r).unwrap();
    assert_eq!(code(e.truncate(r, 0)), ErrorCode::RequestClosed);
    e.check_invariants();
}

#[test]
fn truncate_waits_for_a_step_in_flight_after_a_cancel() {
    let mut e = engine(5);
    let r = req(&mut e);
    let turn = e.begin_turn(r, &[5; 6], &turn_opts("{}")).unwrap();
    run(&mut e, 8);
    run(&mut e, 8);
    let mut buf = vec![0i32; 8 * EVENT_STRIDE_WORDS];
    let RunStart::Execute(mut tx) = e.run_begin(&mut buf, 8).unwrap() else { panic!("a decode step") };
    // Barge-in: the turn is cancelled while its decode row is away.
    assert!(e.cancel_turn(r, turn).unwrap());
    let refused = e.truncate(r, 6).unwrap_err();
    assert_eq!(refused.code, ErrorCode::RunInProgress);
    assert!(refused.code.retryable());
    tx.execute();
    e.run_commit(tx, &mut buf, 8);
    e.check_invariants();
    e.truncate(r, 6).unwrap();
    e.check_invariants();
    assert_eq!(held_blocks(&e), 2, "6 computed tokens need 2 blocks");
    run_all(&mut e, 8);
    // Other requests' rows in flight do not block it.
    let other = req(&mut e);
    e.begin_turn(other, &[9; 3], &turn_opts(r#"{"maxGeneratedTokens":2}"#)).unwrap();
    let RunStart::Execute(mut tx) = e.run_begin(&mut buf, 8).unwrap() else { panic!("a prefill step") };
    e.truncate(r, 1).unwrap();
    tx.execute();
    e.run_commit(tx, &mut buf, 8);
    run_all(&mut e, 8);
    e.check_invariants();
    e.close_request(r).unwrap();
    e.close_request(other).unwrap();
    assert_eq!(held_blocks(&e), 0, "every block is free once both are closed");
}

#[test]
fn truncate_of_a_preempted_or_empty_request_is_harmless() {
    let mut e = engine(6);
    let r = req(&mut e);
    e.truncate(r, 0).unwrap();
    assert_eq!(code(e.truncate(r, 1)), ErrorCode::InvalidArgument);
    e.prefill(r, &[4; 5]).unwrap();
    e.truncate(r, 2).unwrap();
    run_all(&mut e, 4);
    assert_eq!(e.stats().prompt_tokens, 2);
    assert_eq!(held_blocks(&e), 1);
    e.check_invariants();
}
