"""Manifests (adaptiveload/sched/manifest.py): formats, Open-Sora CSV, bad rows, the reference mix."""

import numpy as np
import pytest

from adaptiveload.sched import Manifest, load_manifest, reference_mix, sequence_length, write_manifest

OPEN_SORA_CSV = '''path,text,num_frames,height,width,aspect_ratio,resolution,fps
/data/a.mp4,"A dog runs, then stops.",81.0,480.0,832.0,0.5769,399360.0,16.0
/data/b.jpg,"An image, with ""quotes""",1.0,720.0,1280.0,0.5625,921600.0,
/data/c.mp4,a clip,33.0,486.0,838.0,0.58,407268.0,24.0
'''


def test_open_sora_csv_as_written(tmp_path):
    path = tmp_path / "opensora.csv"
    path.write_text(OPEN_SORA_CSV)
    m = load_manifest(path)
    assert m.seq_lens.tolist() == [32760, 3600, 9 * 30 * 52]  # 486x838 floors to the 480x832 bucket
    assert m.latent_shapes.tolist() == [[21, 60, 104], [1, 90, 160], [9, 60, 104]]
    assert m.pixel_shapes.tolist() == [[81, 480, 832], [1, 720, 1280], [33, 486, 838]]
    assert m.seq_lens.dtype == np.int64 and m.latent_shapes.dtype == np.int64


@pytest.mark.parametrize("ext", ["csv", "jsonl", "parquet"])
def test_round_trip(tmp_path, ext):
    m = reference_mix(500, seed=3)
    path = tmp_path / f"m.{ext}"
    write_manifest(m, path)
    back = load_manifest(path)
    np.testing.assert_array_equal(back.pixel_shapes, m.pixel_shapes)
    np.testing.assert_array_equal(back.latent_shapes, m.latent_shapes)
    np.testing.assert_array_equal(back.seq_lens, m.seq_lens)


def test_seq_len_only(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text('{"seq_len": 1560}\n\n{"seq_len": 32760.0, "text": "x"}\n')
    m = load_manifest(path)
    assert m.seq_lens.tolist() == [1560, 32760] and m.latent_shapes is None
    assert m.bucket_keys.tolist() == [[1560], [32760]]
    write_manifest(m, tmp_path / "s.csv")
    assert (tmp_path / "s.csv").read_text().splitlines() == ["seq_len", "1560", "32760"]


def test_latent_columns_win_and_give_exact_shapes(tmp_path):
    """latent_t,latent_h,latent_w are the tensors' shapes: S = T/pt * H/ph * W/pw whatever the VAE
    stride, and they win over pixel columns in the same file."""
    path = tmp_path / "m.csv"
    path.write_text("num_frames,height,width,latent_t,latent_h,latent_w\n81,480,832,11,16,26\n1,480,832,1,16,26\n")
    m = load_manifest(path, vae_stride=(8, 32, 32), patch_size=(1, 2, 2))
    assert m.latent_shapes.tolist() == [[11, 16, 26], [1, 16, 26]] and m.pixel_shapes is None
    assert m.seq_lens.tolist() == [11 * 8 * 13, 8 * 13]
    assert load_manifest(path, patch_size=(1, 1, 1)).seq_lens.tolist() == [11 * 16 * 26, 16 * 26]
    with pytest.raises(ValueError, match=r"row 1 \(line 2\): field 'latent_t' = 11 is not a multiple of the patch size 2"):
        load_manifest(path, patch_size=(2, 2, 2))
    with pytest.raises(ValueError, match="latent_w 3 at index 1 is not a positive multiple of the patch size 2"):
        Manifest.from_latents([1, 1], [2, 2], [2, 3])


@pytest.mark.parametrize("ext", ["csv", "jsonl", "parquet"])
def test_sample_file_columns_resolve_against_the_manifest_folder_and_round_trip(tmp_path, ext):
    rows = [{"latent_path": "lat/a,1.pt", "text_path": "txt/a.pt", "latent_t": 2, "latent_h": 4, "latent_w": 6},
            {"latent_path": "/abs/b.safetensors", "text_path": "b.safetensors", "latent_t": 1, "latent_h": 2,
             "latent_w": 2}]
    path = tmp_path / f"m.{ext}"
    if ext == "csv":
        import csv
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif ext == "jsonl":
        import json
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table({k: [r[k] for r in rows] for k in rows[0]}), path)
    m = load_manifest(path)
    assert m.latent_paths.tolist() == [str(tmp_path / "lat" / "a,1.pt"), "/abs/b.safetensors"]
    assert m.text_paths.tolist() == [str(tmp_path / "txt" / "a.pt"), str(tmp_path / "b.safetensors")]
    assert m.latent_shapes.tolist() == [[2, 4, 6], [1, 2, 2]] and m.seq_lens.tolist() == [12, 1]
    first = m.head(1)
    assert first.latent_paths.tolist() == m.latent_paths[:1].tolist() and first.text_paths.tolist() == m.text_paths[:1].tolist()
    write_manifest(m, tmp_path / f"back.{ext}")
    back = load_manifest(tmp_path / f"back.{ext}")
    assert back.latent_paths.tolist() == m.latent_paths.tolist() and back.text_paths.tolist() == m.text_paths.tolist()
    np.testing.assert_array_equal(back.latent_shapes, m.latent_shapes)


def test_pixel_columns_with_sample_files(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"num_frames": 81, "height": 480, "width": 832, "latent_path": "a.pt", "text_path": "t.pt"}\n')
    m = load_manifest(path)
    assert m.latent_shapes.tolist() == [[21, 60, 104]] and m.pixel_shapes.tolist() == [[81, 480, 832]]
    assert m.latent_paths.tolist() == [str(tmp_path / "a.pt")] and m.text_paths.tolist() == [str(tmp_path / "t.pt")]


@pytest.mark.parametrize("body, match", [
    ("num_frames,height,width\n81,480,832\n,480,832\n", r"m\.csv: row 2 \(line 3\): field 'num_frames' is missing"),
    ("num_frames,height,width\n81,480,832\n81,-480,832\n", r"row 2 \(line 3\): field 'height' = '-480' must be positive"),
    ("num_frames,height,width\n81,480,832\n81,480,832.5\n", r"row 2 \(line 3\): field 'width' = '832.5' is not an integer"),
    ("num_frames,height,width\n81,abc,832\n", r"row 1 \(line 2\): field 'height' = 'abc' is not a number"),
    ("num_frames,height,width\n81,480\n", r"row 1 \(line 2\): field 'width' is missing"),
    ("num_frames,height,width\n81,8,832\n", r"row 1 \(line 2\): field 'height' = 8 is below one patch"),
    ("frames,h,w\n81,480,832\n",
     "no size columns: expected num_frames,height,width or latent_t,latent_h,latent_w or seq_len; found frames,h,w"),
    ("latent_t,latent_h,latent_w\n3,4,6\n3,5,6\n", r"row 2 \(line 3\): field 'latent_h' = 5 is not a multiple of the patch size 2"),
    ("seq_len,latent_path\n5,a.pt\n", "has a latent_path column but no text_path column: give both, or neither"),
    ("seq_len,latent_path,text_path\n5,a.pt,b.pt\n", "sample files need the shape; seq_len alone gives none"),
    ("latent_t,latent_h,latent_w,latent_path,text_path\n1,2,2,a.pt,\n", r"row 1 \(line 2\): field 'text_path' is missing"),
    ("num_frames,height,width\n", "no rows"),
    ("", "empty file"),
])
def test_bad_csv(tmp_path, body, match):
    path = tmp_path / "m.csv"
    path.write_text(body)
    with pytest.raises(ValueError, match=match):
        load_manifest(path)


def test_bad_jsonl_and_parquet(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"seq_len": 10}\n{"seq_len": 0}\n')
    with pytest.raises(ValueError, match=r"m\.jsonl: row 2 \(line 2\): field 'seq_len' = 0 must be positive"):
        load_manifest(path)
    path.write_text('{"seq_len": 10}\n{oops\n')
    with pytest.raises(ValueError, match=r"line 2: invalid JSON"):
        load_manifest(path)
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"num_frames": [1, None], "height": [480, 480], "width": [832, 832]}), tmp_path / "m.parquet")
    with pytest.raises(ValueError, match=r"m\.parquet: row 2: field 'num_frames' is missing"):
        load_manifest(tmp_path / "m.parquet")


def test_missing_file_and_extension(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.csv"):
        load_manifest(tmp_path / "nope.csv")
    with pytest.raises(ValueError, match="unknown manifest format '.txt'"):
        load_manifest(tmp_path / "m.txt")


def test_reference_mix_matches_its_definition():
    m = reference_mix(200_000, seed=0)
    frames, h, w = m.pixel_shapes.T
    assert np.mean(frames == 1) == pytest.approx(0.30, abs=0.005)
    video = frames > 1
    for f, prob in zip((17, 33, 49, 65, 81), (0.10, 0.15, 0.20, 0.20, 0.35)):
        assert np.mean(frames[video] == f) == pytest.approx(prob, abs=0.005)
    assert np.mean(h == 480) == pytest.approx(0.70, abs=0.005)
    assert set(zip(h.tolist(), w.tolist())) == {(480, 832), (720, 1280)}
    assert m.seq_lens.min() == 1560 and m.seq_lens.max() == 75600
    assert len(np.unique(m.latent_shapes, axis=0)) == 12
    np.testing.assert_array_equal(m.seq_lens, sequence_length(frames, h, w))
    np.testing.assert_array_equal(reference_mix(1000, seed=5).seq_lens, reference_mix(1000, seed=5).seq_lens)
    assert not np.array_equal(reference_mix(1000, seed=5).seq_lens, reference_mix(1000, seed=6).seq_lens)


def test_manifest_constructors():
    m = Manifest.from_seq_lens([5, 6])
    assert len(m) == 2
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        Manifest.from_seq_lens([5, 0])
