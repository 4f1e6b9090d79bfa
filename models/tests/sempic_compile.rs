//! Position-independent document caches (`docs/method.md` §5.1) on the real SmolLM2 GGUF: a
//! document compiled alone moves to any offset by re-rotating its keys, stitched documents are a
//! cache the model continues from, and one stitched document plus a question is the plain prefill
//! of the same tokens. The comparisons run on the f32 paths, where they hold to float precision.

mod common;

use candle_core::Tensor;
use common::{max_abs, max_abs_diff, real, tiny_model, wikitext_tokens};
use scd_models::boundary::{Boundary, BoundaryError};
use scd_models::codec::{self, encode_documents, CodecError, Documents, Prefix};
use scd_models::sampling::argmax;
use scd_models::sempic::{stitch, CompiledDoc};
use scd_models::{
    AdapterMode, DecodeWeights, ForwardError, Input, Llama, LogitsWanted, LoraAdapter,
    PrefillMatmul, Proj,
};
use scd_types::{CodeDType, CodeKind, LayerCode};

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
    let data = scd_models::eval::EvalData::load(&common::eval_data_dir()).unwrap();
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
    use scd_models::eval::multidoc::{
        answer, build_items, evaluate, pieces, DocCompilers, DocMode,
    };
    let (model, tok) = real();
    let data = scd_models::eval::EvalData::load(&common::eval_data_dir()).unwrap();
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
        let a = answer(model, &DocCompilers::default(), tok, &p, mode, 8).unwrap();
        assert!(!a.contains('\n'), "{mode}: {a:?}");
    }
    // SemPIC needs a writer, packet and joint their boundary tokens; with the base itself as
    // the writer SemPIC is plain stitching.
    for mode in [DocMode::SemPic, DocMode::Packet, DocMode::Joint] {
        assert!(answer(model, &DocCompilers::default(), tok, &p, mode, 8).is_err());
    }
    let tokens = Boundary::init(model, 2, 2, 0).unwrap();
    let compilers = DocCompilers {
        writer: Some(model),
        packet: Some(&tokens),
        joint: Some(&tokens),
    };
    let modes = [
        DocMode::FullRecompute,
        DocMode::NoRecompute,
        DocMode::SemPic,
        DocMode::Packet,
        DocMode::Joint,
    ];
    let scores = evaluate(model, &compilers, tok, &items, &modes, 8, 0, |_, _| {}).unwrap();
    assert_eq!(scores.len(), 5);
    for s in &scores {
        assert_eq!(s.f1.n, 2);
        let mean = s.f1_per_question.iter().sum::<f64>() / 2.0;
        assert!((mean - s.f1.value).abs() < 1e-9, "{s:?}");
        assert!((0.0..=100.0).contains(&s.f1.value));
    }
    assert!(scores[0].kl.is_none(), "full recompute is the reference");
    // The gap's two ends have no share of it to report; every other mode has one.
    assert!(scores[0].gap_recovered.is_none() && scores[1].gap_recovered.is_none());
    assert!(scores[2..].iter().all(|s| s.gap_recovered.is_some()));
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
    // Untrained boundary tokens change what the documents hold; with the base as the writer
    // the joint mode is the packet mode.
    let packet = scores[3].kl.unwrap();
    assert!(packet.value.is_finite() && packet.value != plain.value);
    assert_eq!(scores[4].kl.unwrap().value, packet.value);
    assert!(scores[3].kv_deviation.is_some());
}

#[test]
fn boundary_tokens_are_the_rows_a_document_compiles_between() {
    let (model, tok) = real();
    let model = &f32_paths(model);
    let words = wikitext_tokens(tok, 200);
    let (head_ids, doc, tail_ids) = (&words[0..3], &words[20..80], &words[90..92]);
    // Tokens that are exactly some words' embeddings compile as those words would.
    let rows = |ids: &[u32]| {
        model
            .embedding()
            .index_select(&Tensor::new(ids, &candle_core::Device::Cpu).unwrap(), 0)
            .unwrap()
    };
    let b = Boundary::new(rows(head_ids), rows(tail_ids), model).unwrap();
    let packed = CompiledDoc::compile_with(model, doc, Some(&b)).unwrap();
    let all: Vec<u32> = [head_ids, doc, tail_ids].concat();
    let plain = CompiledDoc::compile(model, &all).unwrap();
    assert_eq!(packed.len(), all.len());
    assert_eq!(packed.tokens(), doc);
    assert_eq!(packed.boundary_counts(), (3, 2));
    assert_eq!(
        packed.boundary_sha256(),
        Some(b.content_sha256().unwrap().as_str())
    );
    for layer in [0, 15, 29] {
        let (k, v) = packed.layer_at(model.rope(), layer, 40).unwrap();
        let (k0, v0) = plain.layer_at(model.rope(), layer, 40).unwrap();
        assert!(max_abs_diff(&k, &k0) <= 1e-4 * max_abs(&k0).max(1.0));
        assert!(max_abs_diff(&v, &v0) <= 1e-4 * max_abs(&v0).max(1.0));
    }
    // Tokens trained for the base refuse a writer (another adapter), and the reverse.
    let (_dir, tiny) = tiny_model(5);
    assert!(Boundary::new(rows(head_ids), rows(tail_ids), &tiny).is_err());
    let adapter = LoraAdapter::init(model.config(), 2, 4.0, &[Proj::Q], 1).unwrap();
    let writer = model.with_adapter(&adapter, AdapterMode::Merge).unwrap();
    let err = CompiledDoc::compile_with(&writer, doc, Some(&b)).unwrap_err();
    assert!(
        matches!(&err, ForwardError::Boundary(e) if matches!(**e, BoundaryError::ForeignModel { .. })),
        "{err}"
    );
}

#[test]
fn boundary_tokens_round_trip_and_refuse_corrupt_or_foreign_files() {
    let (model, _) = real();
    let dir = tempfile::tempdir().unwrap();
    let b = Boundary::init(model, 3, 1, 7).unwrap();
    assert_eq!(b.counts(), (3, 1));
    let meta = b.save(dir.path()).unwrap();
    assert_eq!((meta.header, meta.trailer), (3, 1));
    let back = Boundary::load(dir.path(), model).unwrap();
    assert_eq!(back.content_sha256().unwrap(), meta.sha256);
    assert_eq!(max_abs_diff(back.header(), b.header()), 0.0);
    // Seeded, and the tokens start apart.
    assert_eq!(
        Boundary::init(model, 3, 1, 7)
            .unwrap()
            .content_sha256()
            .unwrap(),
        meta.sha256
    );
    assert!(max_abs_diff(&b.header().get(0).unwrap(), &b.header().get(1).unwrap()) > 1e-3);
    // For a writer: refused.
    let adapter = LoraAdapter::init(model.config(), 2, 4.0, &[Proj::Q], 1).unwrap();
    let writer = model.with_adapter(&adapter, AdapterMode::Merge).unwrap();
    assert!(matches!(
        Boundary::load(dir.path(), &writer),
        Err(BoundaryError::ForeignModel { .. })
    ));
    // A changed value: refused by the content hash.
    let file = dir.path().join(scd_models::boundary::BOUNDARY_FILE);
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 2;
    bytes[last] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    assert!(matches!(
        Boundary::load(dir.path(), model),
        Err(BoundaryError::Corrupt { .. })
    ));
    // Truncated: not a safetensors file.
    std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
    assert!(matches!(
        Boundary::load(dir.path(), model),
        Err(BoundaryError::Format { .. })
    ));
    // No description: an error naming the file.
    std::fs::remove_file(dir.path().join(scd_models::boundary::BOUNDARY_META_FILE)).unwrap();
    let err = Boundary::load(dir.path(), model).unwrap_err();
    assert!(err.to_string().contains("boundary.json"), "{err}");
}

#[test]
fn kv_deviation_compares_documents_moved_by_boundary_tokens_at_their_own_positions() {
    use scd_models::eval::multidoc::{build_items, kv_deviation, pieces, Pieces};
    use scd_models::sempic::stitch_after_head;
    let (model, tok) = real();
    let model = &f32_paths(model);
    let data = scd_models::eval::EvalData::load(&common::eval_data_dir()).unwrap();
    let item = &build_items(&data.squad, 1, (2, 2), 5)[0];
    let p: Pieces = pieces(tok, item).unwrap();
    let mut full = model.new_cache();
    model
        .forward(
            Input::new(&[p.head.clone(), p.documents.concat()].concat())
                .with_cache(&mut full)
                .logits(LogitsWanted::None),
        )
        .unwrap();
    // A trailer alone leaves each document's own rows as plain stitching computes them (it
    // comes after them), but moves every later document by one position.
    let trailer = Boundary::init(model, 0, 1, 0).unwrap();
    let compile = |b: Option<&Boundary>| {
        let docs: Vec<CompiledDoc> = p
            .documents
            .iter()
            .map(|d| CompiledDoc::compile_with(model, d, b).unwrap())
            .collect();
        stitch_after_head(model, &p.head, &docs).unwrap()
    };
    let plain = kv_deviation(model.rope(), &full, &compile(None), &p, (0, 0)).unwrap();
    let moved = kv_deviation(model.rope(), &full, &compile(Some(&trailer)), &p, (0, 1)).unwrap();
    assert!(plain.0 > 1e-3 && plain.1 > 1e-3, "{plain:?}");
    assert!(
        (plain.0 - moved.0).abs() < 1e-4 && (plain.1 - moved.1).abs() < 1e-4,
        "{plain:?} vs {moved:?}"
    );
    // The caches' lengths must fit the boundary counts given.
    assert!(kv_deviation(model.rope(), &full, &compile(None), &p, (0, 1)).is_err());
}

#[test]
fn the_writer_never_trains_on_an_article_the_evaluation_reads() {
    use scd_models::eval::multidoc::{writer_split, WRITER_ARTICLES};
    let data = scd_models::eval::EvalData::load(&common::eval_data_dir()).unwrap();
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

#[test]
fn the_document_store_compiles_once_and_never_mixes_writers() {
    use scd_models::sempic::{document_id, stitch_after_head, DocStore, StoreError, WriterVersion};
    let (model, tok) = real();
    let model = &f32_paths(model);
    let words = wikitext_tokens(tok, 200);
    let (head, doc) = (&words[0..4], &words[10..70]);
    let dir = tempfile::tempdir().unwrap();
    let store = DocStore::open(dir.path()).unwrap();
    let first = store.get_or_compile(model, model, None, doc).unwrap();
    assert_eq!((store.compilations(), store.hits()), (1, 0));
    let again = store.get_or_compile(model, model, None, doc).unwrap();
    assert_eq!(
        (store.compilations(), store.hits()),
        (1, 1),
        "a hit computes nothing"
    );
    for layer in [0, 29] {
        let (k, v) = first.layer_at(model.rope(), layer, 9).unwrap();
        let (k2, v2) = again.layer_at(model.rope(), layer, 9).unwrap();
        assert_eq!(max_abs_diff(&k, &k2), 0.0);
        assert_eq!(max_abs_diff(&v, &v2), 0.0);
    }
    // After a restart the entry is still there.
    let reopened = DocStore::open(dir.path()).unwrap();
    let (_, compiled) = reopened.fetch(model, model, None, doc).unwrap();
    assert!(!compiled, "a stored document is not compiled again");
    assert_eq!((reopened.compilations(), reopened.hits()), (0, 1));
    let base_version = WriterVersion::of(model, None).unwrap();
    assert_eq!(reopened.ids(&base_version).unwrap(), [document_id(doc)]);
    // Another writer (an adapter) and boundary tokens are other versions: compiled anew, stored
    // beside, never returned for the base.
    let adapter = LoraAdapter::init(model.config(), 2, 4.0, &[Proj::V], 1).unwrap();
    let writer = model.with_adapter(&adapter, AdapterMode::Merge).unwrap();
    let written = store.get_or_compile(model, &writer, None, doc).unwrap();
    let b = Boundary::init(model, 2, 1, 0).unwrap();
    let packed = store.get_or_compile(model, model, Some(&b), doc).unwrap();
    assert_eq!(store.compilations(), 3);
    let stored_packed = store.get_or_compile(model, model, Some(&b), doc).unwrap();
    assert_eq!(stored_packed.len(), doc.len() + 3);
    assert_eq!(stored_packed.boundary_sha256(), packed.boundary_sha256());
    let versions = [
        WriterVersion::of_doc(&first),
        WriterVersion::of_doc(&written),
        WriterVersion::of_doc(&packed),
    ];
    assert_ne!(versions[0].id(), versions[1].id());
    assert_ne!(versions[0].id(), versions[2].id());
    // Each version lists only its own entries.
    assert_eq!(store.ids(&versions[1]).unwrap(), [document_id(doc)]);
    let unused = WriterVersion {
        boundary_sha256: Some("0".repeat(64)),
        ..versions[0].clone()
    };
    assert!(store.ids(&unused).unwrap().is_empty());
    // One prompt never mixes writer versions.
    let err = stitch_after_head(model, head, &[first.clone(), written.clone()]).unwrap_err();
    assert!(matches!(err, ForwardError::MixedWriters { .. }), "{err}");
    assert!(stitch_after_head(model, head, &[first.clone(), again]).is_ok());
    // An entry at another version's address, or a truncated one, is refused.
    let id = document_id(doc);
    let (plain_path, writer_path) = (
        store.path_of(&versions[0], &id),
        store.path_of(&versions[1], &id),
    );
    std::fs::copy(&plain_path, &writer_path).unwrap();
    assert!(matches!(
        store.get(model, &versions[1], &id),
        Err(StoreError::Format { .. })
    ));
    let bytes = std::fs::read(&plain_path).unwrap();
    std::fs::write(&plain_path, &bytes[..bytes.len() / 3]).unwrap();
    let err = store.get(model, &versions[0], &id).unwrap_err();
    assert!(matches!(err, StoreError::Format { .. }), "{err}");
    // A model of another shape cannot read an entry.
    std::fs::write(&plain_path, &bytes).unwrap();
    let (_tiny_dir, tiny) = tiny_model(3);
    assert!(store.get(&tiny, &versions[0], &id).is_err());
}

#[test]
fn needles_hide_one_number_in_one_paragraph_of_real_text() {
    use scd_models::eval::multidoc::pieces;
    use scd_models::eval::needle::{haystack_paragraphs, needle_items};
    let (_, tok) = real();
    let data = scd_models::eval::EvalData::load(&common::eval_data_dir()).unwrap();
    assert!(haystack_paragraphs(&data.text).len() > 100);
    let items = needle_items(&data.text, 30, (3, 7), 2);
    assert_eq!(items.len(), 30);
    for item in &items {
        assert!((4..=8).contains(&item.documents.len()));
        let number = &item.qa.answers[0];
        assert_eq!(number.len(), 6);
        let holding: Vec<usize> = (0..item.documents.len())
            .filter(|&d| item.documents[d].contains(number.as_str()))
            .collect();
        assert_eq!(
            holding,
            vec![item.gold],
            "the number is only in the needle's paragraph"
        );
        assert!(item.documents[item.gold].contains("The secret number of the "));
        let key = item
            .qa
            .question
            .trim_end_matches('?')
            .rsplit(' ')
            .next()
            .unwrap();
        assert!(item.documents[item.gold].contains(&format!("of the {key} is {number}.")));
        assert!(
            !item.documents[item.gold].contains(" @-@ "),
            "WikiText spacing undone"
        );
        assert!(pieces(tok, item).unwrap().documents.len() == item.documents.len());
    }
    let again = needle_items(&data.text, 30, (3, 7), 2);
    assert!(items
        .iter()
        .zip(&again)
        .all(|(a, b)| a.documents == b.documents));
    let other = needle_items(&data.text, 30, (3, 7), 3);
    assert!(items
        .iter()
        .zip(&other)
        .any(|(a, b)| a.documents != b.documents));
}

#[test]
fn served_documents_decode_to_the_stitched_cache_with_the_prompt_read_after_them() {
    let (model, tok) = real();
    let model = &f32_paths(model);
    let words = wikitext_tokens(tok, 260);
    let (a, b, prompt) = (&words[0..90], &words[100..180], &words[200..230]);
    let docs = [
        CompiledDoc::compile(model, a).unwrap(),
        CompiledDoc::compile(model, b).unwrap(),
    ];
    let layers = model.config().num_layers;
    let codes = |dtype| {
        let mut out = Vec::new();
        for l in 0..layers {
            encode_documents(model.rope(), &docs, l, dtype, &mut out).unwrap();
        }
        out
    };
    let (prefix, last) = (&prompt[..prompt.len() - 1], prompt[prompt.len() - 1]);
    // The reference: the stitched documents, then the prompt read by the model itself.
    let refs: Vec<&CompiledDoc> = docs.iter().collect();
    let mut want = stitch(model, &refs).unwrap();
    model
        .forward(
            Input::new(prefix)
                .with_cache(&mut want)
                .logits(LogitsWanted::None),
        )
        .unwrap();
    let want_logits = last_logits(model, Input::new(&[last]).with_cache(&mut want));
    let f32_codes = codes(CodeDType::F32);
    assert_eq!(f32_codes.len(), 2 * layers);
    assert_eq!(f32_codes[0].shape, [170, model.config().kv_dim() as u32]);
    let mut got = codec::decode(&Documents, model, &f32_codes, Prefix::new(prefix)).unwrap();
    assert_eq!(got.next_position(), a.len() + b.len() + prefix.len());
    let got_logits = last_logits(model, Input::new(&[last]).with_cache(&mut got));
    assert_eq!(
        got_logits, want_logits,
        "f32 codes are the stitched cache, exactly"
    );
    // bf16 halves the bytes and keeps the answer.
    let bf16_codes = codes(CodeDType::BF16);
    assert_eq!(
        codec::payload_bytes(&bf16_codes) * 2,
        codec::payload_bytes(&f32_codes)
    );
    let mut narrow = codec::decode(&Documents, model, &bf16_codes, Prefix::new(prefix)).unwrap();
    let narrow_logits = last_logits(model, Input::new(&[last]).with_cache(&mut narrow));
    assert_eq!(argmax(&narrow_logits), argmax(&want_logits));
    let diff = narrow_logits
        .iter()
        .zip(&want_logits)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(diff < 0.5, "bf16 documents move the logits by {diff}");

    // Bad payloads are typed errors, never panics.
    let decode = |codes: &[LayerCode]| {
        codec::decode(&Documents, model, codes, Prefix::new(prefix)).map(drop)
    };
    let err = decode(&f32_codes[..f32_codes.len() - 1]).unwrap_err();
    assert!(
        matches!(err, CodecError::Missing { kind: "doc_v", .. }),
        "{err}"
    );
    assert!(matches!(
        decode(&[]).unwrap_err(),
        CodecError::Missing { .. }
    ));
    let twice = [f32_codes[0].clone(), f32_codes[0].clone()];
    assert!(matches!(
        decode(&twice).unwrap_err(),
        CodecError::Duplicate { .. }
    ));
    // Rows that disagree with the first code's, or more than the context holds.
    let mut short = f32_codes[2].clone();
    short.shape[0] -= 1;
    short
        .bytes
        .truncate(short.bytes.len() - 4 * model.config().kv_dim());
    let err = decode(&[f32_codes[0].clone(), short]).unwrap_err();
    assert!(matches!(err, CodecError::Shape { .. }), "{err}");
    let mut huge = f32_codes[0].clone();
    huge.shape[0] = model.config().context_length as u32;
    assert!(matches!(
        decode(&[huge]).unwrap_err(),
        CodecError::Shape { .. }
    ));
    let mut raw = f32_codes[0].clone();
    raw.kind = CodeKind::RAW_K;
    assert!(matches!(
        decode(&[raw]).unwrap_err(),
        CodecError::UnexpectedCode { .. }
    ));
    let mut q = f32_codes[0].clone();
    q.dtype = CodeDType::Q4;
    assert!(matches!(
        decode(&[q]).unwrap_err(),
        CodecError::DType { .. }
    ));
    let mut out = Vec::new();
    assert!(encode_documents(model.rope(), &docs, 0, CodeDType::I8_ROWS, &mut out).is_err());
    assert!(encode_documents(model.rope(), &[], 0, CodeDType::F32, &mut out).is_err());
}

#[test]
fn a_consumer_with_its_own_rope_base_reads_served_documents_at_its_own_rotation() {
    let (model, tok) = real();
    let model = &f32_paths(model);
    let words = wikitext_tokens(tok, 200);
    let (a, b, prompt) = (&words[0..60], &words[80..140], &words[150..160]);
    let docs = [
        CompiledDoc::compile(model, a).unwrap(),
        CompiledDoc::compile(model, b).unwrap(),
    ];
    // mail-rope: the mail expert as a fine-tune that rotates with RoPE base 10^6.
    let adapter = LoraAdapter::load(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../experts/mail-rope/adapter.safetensors"),
        model.config(),
    )
    .unwrap();
    let expert = model.with_adapter(&adapter, AdapterMode::Merge).unwrap();
    assert_ne!(expert.rope(), expert.base_rope());
    let mut codes = Vec::new();
    for l in 0..model.config().num_layers {
        encode_documents(model.rope(), &docs, l, CodeDType::F32, &mut codes).unwrap();
    }
    let cache = codec::decode(&Documents, &expert, &codes, Prefix::new(&prompt[..0])).unwrap();
    // A key's content before RoPE does not depend on where its document was compiled; the
    // expert must find it rotated with its own base at the document's place.
    let pre = |doc: &[u32], layer: usize| {
        model
            .forward(
                Input::new(doc)
                    .capture(scd_models::Capture {
                        k_pre_rope: true,
                        ..scd_models::Capture::none()
                    })
                    .logits(LogitsWanted::None),
            )
            .unwrap()
            .captured
            .into_iter()
            .find(|c| c.layer == layer)
            .and_then(|c| c.k_pre_rope)
            .unwrap()
    };
    for layer in [0, 17] {
        let (k, _) = cache.layer(layer).unwrap().unwrap();
        let positions: Vec<u32> = (a.len() as u32..(a.len() + b.len()) as u32).collect();
        let want = expert.rope().apply(&pre(b, layer), &positions).unwrap();
        let got = k.narrow(0, a.len(), b.len()).unwrap();
        let d = max_abs_diff(&got, &want) / max_abs(&want).max(1.0);
        assert!(d < 1e-4, "layer {layer}: keys off by {d}");
        // Not what the base's rotation gives.
        let base = model.rope().apply(&pre(b, layer), &positions).unwrap();
        assert!(max_abs_diff(&got, &base) > 1e-2);
    }
}
