"""The sample members of each kind: their extensions, in the order they are written, and the fields
of the records they hold."""

from __future__ import annotations

__all__ = [
    "KIND_NAMES",
    "SA1B_JPG",
    "SA1B_ANN",
    "SA1B_JSON",
    "SA1B_RECORD_FIELDS",
    "VQA_IMAGE_EXTS",
    "VQA_RECORD",
    "VQA_RECORD_FIELDS",
    "VQA_IMAGE_FIELDS",
    "VQA_QUESTION_FIELDS",
    "EMB_TABLE",
    "EMB_DATA",
    "EMB_ROW",
    "WEBDATASET",
]

# Member extensions of one sample, per kind, in the order they are written.
SA1B_JPG = "jpg"
SA1B_ANN = "msgpack"
SA1B_JSON = "json"  # an original SA-1B sample (indexed in place) holds `jpg` + `json`, as Meta ships it
# VQA: one image member, `jpg` or `png` as the original file is (never re-encoded but with
# --image-max-side), then the record.
VQA_IMAGE_EXTS = {"JPEG": "jpg", "PNG": "png"}  # Pillow format -> member extension
VQA_RECORD = "msgpack"
# Embeddings: a block of rows, its column table then the columns' bytes (`records.pack_columns`).
EMB_TABLE = "msgpack"
EMB_DATA = "bin"
WEBDATASET = "webdataset"  # any WebDataset tars indexed in place: members grouped by key, decoded by the user
# The kinds a manifest may name (pipeline.kinds.KINDS holds their code).
KIND_NAMES = ("sa1b", "vqa", "embeddings", WEBDATASET)

# The SA-1B annotation record (msgpack map). Geometry is in the original image frame
# (`image.width` x `image.height`), whatever size the stored JPEG has (`stored_size`).
SA1B_RECORD_FIELDS = (
    "image",  # {"image_id": int, "width": int, "height": int, "file_name": str}
    "stored_size",  # [height, width] of the stored JPEG
    "counts",  # list of bytes: COCO compressed RLE strings, one per mask, size = [height, width]
    "ids",  # int64 (N,)
    "bbox",  # float64 (N, 4) XYWH
    "area",  # float64 (N,)
    "predicted_iou",  # float64 (N,)
    "stability_score",  # float64 (N,)
    "point_coords",  # float64 (P, 2): all masks' points, concatenated
    "point_counts",  # uint32 (N,): points per mask
    "crop_box",  # float64 (N, 4) XYWH
)

# The VQA record (msgpack map): one image of one split and all the questions of that split about it.
VQA_RECORD_FIELDS = (
    "image",  # {"path", "width", "height", "format", "mode", "sha256"}: the input file (path relative to --images)
    "stored_size",  # [height, width] of the stored image (smaller than the original with --image-max-side)
    "split",  # the split it was packed into
    "questions",  # list, one map per question (VQA_QUESTION_FIELDS), in input order
)
VQA_IMAGE_FIELDS = ("path", "width", "height", "format", "mode", "sha256")
VQA_QUESTION_FIELDS = (
    "question",  # str, as asked (LLaVA: the human turn without its <image> token)
    "answer",  # str (JSON numbers and booleans as JSON text)
    "source",  # the annotation file, as given to the packer
    "record",  # index of the record in that file
    "turn",  # index of the question among the record's (LLaVA conversations: one per human/gpt pair; else 0)
    "layout",  # "vqa-rad", "slake", "llava" or "mapped"
    "fields",  # the original JSON record, every field as it was
)
# Embeddings: the column holding each row's index in the packed input arrays (int64).
EMB_ROW = "row"
