//! A turn's output in the core (output.rs, issue 29 item 1): events carry their text delta, stop
//! strings end a turn in the transaction that produced them, logprobs carry their token text.

mod common;

use common::*;
use ortex_core::events::{word, FinishReason, StopMatch};
use ortex_core::{Engine, RequestId, RequestOptions, TurnId, EVENT_STRIDE_WORDS};

/// One event with its text and the numbers of its log-probability entry (empty: none).
#[derive(Debug, Clone)]
struct TextEv {
    ev: Ev,
    stop_kind: i32,
    stop_index: i32,
    text: String,
    logprobs: Vec<f64>,
}

/// One run, each event with its text sliced out of the run's text by its UTF-16 words.
fn run_text(engine: &mut Engine, capacity: usize) -> Vec<TextEv> {
    let mut words = vec![0i32; capacity * EVENT_STRIDE_WORDS];
    let count = engine.run(&mut words, capacity).expect("run succeeds");
    engine.check_invariants();
    let output = engine.run_output();
    let units: Vec<u16> = output.text.encode_utf16().collect();
    decode(&words, count)
        .into_iter()
        .enumerate()
        .map(|(i, ev)| {
            let record = &words[i * EVENT_STRIDE_WORDS..(i + 1) * EVENT_STRIDE_WORDS];
            let start = record[word::TEXT_START] as usize;
            let text = String::from_utf16(&units[start..start + record[word::TEXT_LENGTH] as usize]).unwrap();
            let logprobs = match record[word::LOGPROBS] {
                -1 => Vec::new(),
                at => {
                    let at = at as usize;
                    let top = output.logprobs[at + 4] as usize;
                    output.logprobs[at..at + 5 + 4 * top].to_vec()
                }
            };
            TextEv { ev, stop_kind: record[word::STOP_KIND], stop_index: record[word::STOP_INDEX], text, logprobs }
        })
        .collect()
}

fn run_all_text(engine: &mut Engine, capacity: usize) -> Vec<Vec<TextEv>> {
    let mut runs = Vec::new();
    while engine.has_pending_work() {
        runs.push(run_text(engine, capacity));
        assert!(runs.len() < 10_000, "engine did not settle");
    }
    runs
}

fn of_turn(runs: &[Vec<TextEv>], request: RequestId, turn: TurnId) -> Vec<TextEv> {
    runs.iter().flatten().filter(|e| e.ev.request == request.0 && e.ev.turn == turn.0).cloned().collect()
}

fn text_of(events: &[TextEv]) -> String {
    events.iter().map(|e| e.text.as_str()).collect()
}

const ENGINE: &str = r#"{"seed":5,"eosProbability":0}"#;
const TURN: &str = r#"{"maxGeneratedTokens":24,"ignoreEos":true,"temperature":1,"seed":9}"#;

/// The tokens and text of one turn on a fresh engine, with `extra` turn options.
fn one_turn(extra: &str) -> (Vec<TextEv>, Engine, RequestId) {
    let mut engine = sim(ENGINE);
    let request = engine.create_request(&RequestOptions::default()).unwrap();
    let options = format!("{}{extra}}}", &TURN[..TURN.len() - 1]);
    let turn = engine.begin_turn(request, &[5, 6, 7], &turn_opts(&options)).unwrap();
    let runs = run_all_text(&mut engine, 64);
    (of_turn(&runs, request, turn), engine, request)
}

#[test]
fn token_events_carry_the_text_of_the_whole_turn() {
    let (events, engine, _) = one_turn("");
    let tokens: Vec<i32> = events.iter().filter(|e| e.ev.is_token()).map(|e| e.ev.token).collect();
    assert_eq!(tokens.len(), 24);
    let whole = engine.detokenize(&tokens).unwrap();
    assert!(!whole.is_empty());
    assert_eq!(text_of(&events), whole);
    assert!(events.iter().all(|e| e.logprobs.is_empty()), "no logprobs unless asked");
}

#[test]
fn a_stop_string_spanning_tokens_finishes_the_turn_in_the_run_that_made_it() {
    let (plain, _, _) = one_turn("");
    let whole = text_of(&plain);
    // Every token of the simulated vocabulary past the bytes reads as " " + 4 letters: a stop
    // string of the last letters of one and the space and first letter of the next spans two.
    let from = plain[0].text.len() + plain[1].text.len() - 2;
    let stop = whole[from..from + 4].to_string();
    let at = whole.find(&stop).unwrap();
    let (events, _, _) = one_turn(&format!(r#","stop":["never",{stop:?}]"#));
    assert_eq!(text_of(&events), whole[..at], "the text ends before the stop string");
    let last = events.last().unwrap();
    assert!(last.ev.is_token() && last.ev.is_finished(), "the token that completed it finishes the turn");
    assert_eq!(last.ev.finish, FinishReason::Stop(StopMatch::Text(1)).code() as i32);
    assert_eq!((last.stop_kind, last.stop_index), (2, 1));
    let generated = events.iter().filter(|e| e.ev.is_token()).count();
    let tokens_to_stop = plain.iter().scan(0, |len, e| {
        *len += e.text.len();
        Some(*len)
    });
    let expected = tokens_to_stop.take_while(|&len| len < at + stop.len()).count() + 1;
    assert_eq!(generated, expected, "no token is generated after the one that completed the stop");
    assert_eq!(last.ev.usage.unwrap().1 as usize, generated);
}

#[test]
fn a_cancel_finishes_with_the_text_held_back() {
    let mut engine = sim(ENGINE);
    let request = engine.create_request(&RequestOptions::default()).unwrap();
    // Every word token ends in a vowel: these stop strings hold the last one back.
    let options = format!("{}{}}}", &TURN[..TURN.len() - 1], r#","stop":["a zz","e zz","i zz","o zz","u zz"]"#);
    let turn = engine.begin_turn(request, &[5, 6, 7], &turn_opts(&options)).unwrap();
    let mut runs = Vec::new();
    for _ in 0..4 {
        runs.push(run_text(&mut engine, 64));
    }
    let before = of_turn(&runs, request, turn);
    let tokens: Vec<i32> = before.iter().filter(|e| e.ev.is_token()).map(|e| e.ev.token).collect();
    let whole = engine.detokenize(&tokens).unwrap();
    assert_eq!(text_of(&before), whole[..whole.len() - 1], "the last vowel is held back");
    assert!(engine.cancel_turn(request, turn).unwrap());
    runs.extend(run_all_text(&mut engine, 64));
    let events = of_turn(&runs, request, turn);
    assert_eq!(events.iter().filter(|e| e.ev.is_token()).count(), tokens.len());
    assert_eq!(text_of(&events), whole, "the held-back vowel came with the finish");
    assert!(events.last().unwrap().ev.is_finished());
}

#[test]
fn logprobs_carry_their_token_text() {
    let (events, engine, _) = one_turn(r#","logprobs":2"#);
    let mut tokens = 0;
    for event in events.iter().filter(|e| e.ev.is_token()) {
        tokens += 1;
        let entry = &event.logprobs;
        assert_eq!(entry[0] as i32, event.ev.token);
        assert!(entry[1] <= 0.0);
        assert_eq!(entry[4] as usize, 2, "two alternatives");
        let alternative = entry[5] as i32;
        assert!(engine.detokenize(&[alternative]).is_ok());
    }
    assert_eq!(tokens, 24);
}

#[test]
fn logprob_texts_are_the_tokens_decoded_alone() {
    let mut engine = sim(ENGINE);
    let request = engine.create_request(&RequestOptions::default()).unwrap();
    let options = r#"{"maxGeneratedTokens":3,"ignoreEos":true,"temperature":1,"seed":9,"logprobs":1}"#;
    engine.begin_turn(request, &[5, 6, 7], &turn_opts(options)).unwrap();
    while engine.has_pending_work() {
        let mut words = vec![0i32; 8 * EVENT_STRIDE_WORDS];
        let count = engine.run(&mut words, 8).unwrap();
        let output = engine.run_output();
        let units: Vec<u16> = output.text.encode_utf16().collect();
        let slice = |start: f64, length: f64| String::from_utf16(&units[start as usize..(start + length) as usize]);
        for record in words[..count * EVENT_STRIDE_WORDS].chunks(EVENT_STRIDE_WORDS) {
            let at = record[word::LOGPROBS];
            if at < 0 {
                continue;
            }
            let entry = &output.logprobs[at as usize..];
            let token_text = slice(entry[2], entry[3]).unwrap();
            assert_eq!(token_text, engine.detokenize(&[record[word::TOKEN]]).unwrap());
            let alternative_text = slice(entry[7], entry[8]).unwrap();
            assert_eq!(alternative_text, engine.detokenize(&[entry[5] as i32]).unwrap());
        }
    }
}

#[test]
fn a_turn_that_ends_for_another_reason_flushes_the_text_held_back_into_its_last_event() {
    // Every word token ends in a vowel: these stop strings hold the last one back until the end.
    let (events, engine, _) = one_turn(r#","stop":["a zz","e zz","i zz","o zz","u zz"]"#);
    let tokens: Vec<i32> = events.iter().filter(|e| e.ev.is_token()).map(|e| e.ev.token).collect();
    assert_eq!(tokens.len(), 24);
    let last = events.last().unwrap();
    assert!(last.ev.is_token() && last.ev.is_finished());
    assert_eq!(last.ev.finish, FinishReason::MaxGeneratedTokens.code() as i32);
    assert_eq!(text_of(&events), engine.detokenize(&tokens).unwrap());
}
