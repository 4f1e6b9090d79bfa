//! Position-independent document caches (M9 §1) on the real SmolLM2 GGUF: a document compiled
//! alone moves to any offset by re-rotating its keys, stitched documents are a cache the model
//! continues from, and one stitched document plus a question is the plain prefill of the same
//! tokens. The comparisons run on the f32 paths, where they hold to float precision.

mod common;

use candle_core::Tensor;
use common::{max_abs, max_abs_diff, real, tiny_model, wikitext_tokens};
use scd_models::pic::{stitch, CompiledDoc};
use scd_models::sampling::argmax;
use scd_models::{DecodeWeights, ForwardError, Input, Llama, LogitsWanted, PrefillMatmul};

fn f32_paths(model: &Llama) -> Llama {
    model
        .clone()
        .with_decode_weights(DecodeWeights::F32)
        .unwrap()
        .with_prefill_matmul(PrefillMatmul::F32)
        .unwrap()
}

fn last_logits(model: &Llama, input: Input<'_>) -> Vec<f32> {
    model
        .forward(input.logits(LogitsWanted::Last))
        .unwrap()
        .logits
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

#[test]
fn a_document_compiled_alone_moves_to_any_offset() {
    let (model, tok) = real();
    let model = &f32_paths(model);
    let words = wikitext_tokens(tok, 300);
    let doc = &words[100..260];
    let compiled = CompiledDoc::compile(model, doc).unwrap();
    assert_eq!(compiled.len(), doc.len());
    for offset in [0, 1, 300, 2000] {
        // The same document compiled alone but at `offset`.
        let mut at = model.new_cache();
        model
            .forward(
                Input::new(doc)
                    .with_cache(&mut at)
                    .at(offset)
                    .logits(LogitsWanted::None),
            )
            .unwrap();
        assert_eq!(at.next_position(), offset + doc.len());
        for layer in [0, 7, 29] {
            let (k, v) = compiled.layer_at(model.rope(), layer, offset).unwrap();
            let (k_at, v_at) = at.layer(layer).unwrap().unwrap();
            let dk = max_abs_diff(&k, &k_at) / max_abs(&k_at).max(1.0);
            let dv = max_abs_diff(&v, &v_at) / max_abs(&v_at).max(1.0);
            assert!(
                dk < 1e-4,
                "offset {offset}, layer {layer}: keys differ by {dk}"
            );
            assert!(
                dv < 1e-4,
                "offset {offset}, layer {layer}: values differ by {dv}"
            );
        }
    }
}

#[test]
fn one_stitched_document_and_a_question_equal_the_plain_prefill() {
    let (model, tok) = real();
    let model = &f32_paths(model);
    let doc = wikitext_tokens(tok, 200);
    let question = tok
        .encode("\nQuestion: what is this text about?\nAnswer:", false)
        .unwrap();
    let whole: Vec<u32> = doc.iter().chain(&question).copied().collect();
    let plain = last_logits(model, Input::new(&whole));

    let compiled = CompiledDoc::compile(model, &doc).unwrap();
    let mut cache = stitch(model, &[&compiled]).unwrap();
    assert_eq!((cache.len(), cache.next_position()), (doc.len(), doc.len()));
    let stitched = last_logits(model, Input::new(&question).with_cache(&mut cache));
    let diff = max_abs_diff(
        &Tensor::new(plain.as_slice(), &candle_core::Device::Cpu).unwrap(),
        &Tensor::new(stitched.as_slice(), &candle_core::Device::Cpu).unwrap(),
    );
    assert!(
        diff < 1e-3,
        "stitched logits differ from the plain prefill's by {diff}"
    );
    assert_eq!(argmax(&plain), argmax(&stitched));
    assert_eq!(cache.len(), whole.len());
}

#[test]
fn documents_stitch_in_any_order_and_no_document_sees_another() {
    let (model, tok) = real();
    let model = &f32_paths(model);
    let words = wikitext_tokens(tok, 400);
    let (a, b) = (&words[..150], &words[200..330]);
    let (ca, cb) = (
        CompiledDoc::compile(model, a).unwrap(),
        CompiledDoc::compile(model, b).unwrap(),
    );
    let question = tok.encode("\nSummary:", false).unwrap();
    for (order, first) in [([&ca, &cb], a.len()), ([&cb, &ca], b.len())] {
        let mut cache = stitch(model, &order).unwrap();
        let total = a.len() + b.len();
        assert_eq!((cache.len(), cache.next_position()), (total, total));
        // The second document's keys are what it gives compiled alone where it starts: moved
        // there, and nothing of it recomputed against the first.
        let mut alone = model.new_cache();
        model
            .forward(
                Input::new(order[1].tokens())
                    .with_cache(&mut alone)
                    .at(first)
                    .logits(LogitsWanted::None),
            )
            .unwrap();
        let (k_alone, _) = alone.layer(12).unwrap().unwrap();
        let (k, _) = cache.layer(12).unwrap().unwrap();
        let second = k.narrow(0, first, order[1].len()).unwrap();
        let d = max_abs_diff(&second, &k_alone) / max_abs(&k_alone).max(1.0);
        assert!(d < 1e-4, "the second document's keys differ by {d}");
        let logits = last_logits(model, Input::new(&question).with_cache(&mut cache));
        assert!(logits.iter().all(|l| l.is_finite()));
    }
    // Against full recompute of the same tokens the second document differs: in a plain
    // prefill it attends to the first (what SemPIC's writer learns to make up for).
    let mut full = model.new_cache();
    let ab: Vec<u32> = a.iter().chain(b).copied().collect();
    model
        .forward(
            Input::new(&ab)
                .with_cache(&mut full)
                .logits(LogitsWanted::None),
        )
        .unwrap();
    let (k_full, _) = full.layer(12).unwrap().unwrap();
    let (moved, _) = cb.layer_at(model.rope(), 12, a.len()).unwrap();
    let d = max_abs_diff(&k_full.narrow(0, a.len(), b.len()).unwrap(), &moved);
    assert!(
        d > 1e-2,
        "the second document's keys barely depend on the first: {d}"
    );
}

#[test]
fn foreign_and_oversized_documents_are_refused() {
    let (model, _) = real();
    let (_dir, tiny) = tiny_model(7);
    let doc = CompiledDoc::compile(&tiny, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]).unwrap();
    match stitch(model, &[&doc]) {
        Err(ForwardError::ForeignDocument { writer, reader }) => {
            assert_eq!(writer, tiny.identity().sha256);
            assert_eq!(reader, model.identity().sha256);
        }
        other => panic!("a document of another base was accepted: {other:?}"),
    }
    // The tiny model's window is 32 tokens: three 12-token documents leave no room.
    assert_eq!(tiny.config().context_length, 32);
    match stitch(&tiny, &[&doc, &doc, &doc]) {
        Err(ForwardError::ContextOverflow { needed, context }) => {
            assert_eq!((needed, context), (37, 32));
        }
        other => panic!("an oversized stitch was accepted: {other:?}"),
    }
    let two = stitch(&tiny, &[&doc, &doc]).unwrap();
    assert_eq!(two.len(), 24);
    assert!(stitch(&tiny, &[]).unwrap().is_empty());
    assert!(matches!(
        CompiledDoc::compile(&tiny, &[]),
        Err(ForwardError::EmptyInput)
    ));
}

#[test]
fn multidoc_items_hide_the_gold_paragraph_among_distractors() {
    use scd_models::eval::multidoc::build_items;
    let data = scd_models::eval::EvalData::load(&common::shared_data_dir()).unwrap();
    let items = build_items(&data.squad, 40, (3, 7), 1);
    assert_eq!(items.len(), 40);
    let mut sizes = std::collections::BTreeSet::new();
    let mut gold_places = std::collections::BTreeSet::new();
    for item in &items {
        let n = item.documents.len();
        assert!((4..=8).contains(&n), "{n} documents");
        sizes.insert(n);
        gold_places.insert(item.gold);
        assert_eq!(item.documents[item.gold], item.qa.context);
        let mut distinct = item.documents.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), n, "a paragraph appears twice");
        assert_eq!(
            item.documents
                .iter()
                .filter(|d| **d == item.qa.context)
                .count(),
            1
        );
    }
    // Seeded: the same seed gives the same items, the gold paragraph moves around.
    assert!(sizes.len() > 2 && gold_places.len() > 2);
    let again = build_items(&data.squad, 40, (3, 7), 1);
    assert!(items
        .iter()
        .zip(&again)
        .all(|(a, b)| a.documents == b.documents && a.qa.id == b.qa.id));
}

#[test]
fn both_document_modes_read_the_same_tokens_and_answer() {
    use scd_models::eval::multidoc::{answer, build_items, evaluate, pieces, DocMode};
    let (model, tok) = real();
    let data = scd_models::eval::EvalData::load(&common::shared_data_dir()).unwrap();
    let items = build_items(&data.squad, 2, (1, 1), 3);
    let p = pieces(tok, &items[0]).unwrap();
    let all = p.all();
    let n: usize = p.head.len() + p.documents.iter().map(Vec::len).sum::<usize>() + p.tail.len();
    assert_eq!(all.len(), n);
    assert_eq!(p.documents.len(), 2);
    // The pieces are the prompt: the question is in the tail, each paragraph in its piece.
    let tail = tok.decode(&p.tail, false).unwrap();
    assert!(tail.contains(&items[0].qa.question), "{tail}");
    for (d, text) in p.documents.iter().zip(&items[0].documents) {
        assert!(tok.decode(d, false).unwrap().starts_with(text.as_str()));
    }
    for mode in [DocMode::FullRecompute, DocMode::NoRecompute] {
        let a = answer(model, None, tok, &p, mode, 8).unwrap();
        assert!(!a.contains('\n'), "{mode}: {a:?}");
    }
    // SemPIC needs a writer; with the base itself as the writer it is plain stitching.
    assert!(answer(model, None, tok, &p, DocMode::SemPic, 8).is_err());
    let modes = [
        DocMode::FullRecompute,
        DocMode::NoRecompute,
        DocMode::SemPic,
    ];
    let scores = evaluate(model, Some(model), tok, &items, &modes, 8, 0, |_, _| {}).unwrap();
    assert_eq!(scores.len(), 3);
    for s in &scores {
        assert_eq!(s.f1.n, 2);
        assert!((0.0..=100.0).contains(&s.f1.value));
    }
    assert!(scores[0].kl.is_none(), "full recompute is the reference");
    let (plain, own) = (scores[1].kl.unwrap(), scores[2].kl.unwrap());
    assert!(
        plain.value > 1e-4,
        "stitching loses cross-document attention: {plain:?}"
    );
    assert_eq!(plain.value, own.value);
    // The stitched documents' keys and values lie away from full recompute's, inside the
    // documents as at their starts; the full-recompute cache has no deviation to report.
    assert!(scores[0].kv_deviation.is_none());
    let [edge, inside] = scores[1].kv_deviation.unwrap();
    assert!(
        edge.value > 1e-3 && inside.value > 1e-3,
        "{edge:?} {inside:?}"
    );
    assert_eq!(scores[2].kv_deviation.unwrap()[1].value, inside.value);
    assert_eq!(scores[1].f1.value, scores[2].f1.value);
}

#[test]
fn the_writer_never_trains_on_an_article_the_evaluation_reads() {
    use scd_models::eval::multidoc::{writer_split, WRITER_ARTICLES};
    let data = scd_models::eval::EvalData::load(&common::shared_data_dir()).unwrap();
    let (train, eval) = writer_split(&data.squad);
    assert_eq!(train.len() + eval.len(), data.squad.len());
    let arts = |q: &[scd_models::eval::QaItem]| {
        q.iter()
            .map(|q| q.article)
            .collect::<std::collections::BTreeSet<_>>()
    };
    let (ta, ea) = (arts(&train), arts(&eval));
    assert_eq!(ta.len(), WRITER_ARTICLES);
    assert!(ta.is_disjoint(&ea) && ea.len() >= 8, "{ta:?} {ea:?}");
    assert!(
        ta.iter().all(|a| ea.iter().all(|e| e < a)),
        "the last articles train"
    );
    // No paragraph on both sides either.
    let contexts = |q: &[scd_models::eval::QaItem]| {
        q.iter()
            .map(|q| q.context.clone())
            .collect::<std::collections::BTreeSet<_>>()
    };
    assert!(contexts(&train).is_disjoint(&contexts(&eval)));
    assert!(eval.len() >= 300 && train.len() >= 600);
}
