"""Sample documents for the summarization demo and tests (`freight sample-docs`): twenty short texts,
then four long ones from jobs/domain/sample_texts/ (two of them longer than the default model's context of
2048 tokens, so summarizing them goes through map-reduce). The texts were written for this project
and are distributed under its license, except the Gettysburg Address (Abraham Lincoln, 1863), which is
in the public domain. Nothing is downloaded."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SUMMARIZE_TEMPLATE = "Summarize the following document in two sentences.\n\n{text}"

DOCUMENTS: list[tuple[str, str, str]] = [
    (
        "lighthouse",
        "The Lighthouse Keeper",
        "For forty years the lighthouse on the northern cape was tended by one family. Each evening the keeper "
        "climbed one hundred and twelve steps to trim the wick, polish the great lens and wind the clockwork that "
        "turned the light. In storms the keeper stayed awake all night, because a stopped light could send a ship "
        "onto the rocks. When the light was finally automated, the last keeper left a logbook with every ship she "
        "had seen pass, more than nine thousand entries in a careful hand.",
    ),
    (
        "bread",
        "How Bread Rises",
        "Bread rises because yeast, a single-celled fungus, eats the sugars in flour and releases carbon dioxide. "
        "Kneading stretches the gluten proteins in wheat into long elastic strands that trap the gas in small "
        "bubbles. A slow, cool rise gives the yeast and bacteria time to make flavour compounds, which is why "
        "many bakers leave dough overnight. In the oven the trapped gas expands, the yeast dies, and the starches "
        "set around the bubbles to give the crumb its structure.",
    ),
    (
        "canal",
        "The Village Canal",
        "The canal was dug by hand in the eighteenth century to carry coal from the hills to the river port. For a "
        "hundred years horses pulled narrow boats along the towpath, each boat carrying as much as a team of wagons. "
        "The railway ended that trade within a generation, and the canal silted up. Volunteers cleared it in the "
        "1970s, rebuilt three locks, and today it carries holiday boats, anglers and a heron that nests by the "
        "second lock every spring.",
    ),
    (
        "bees",
        "Why Bees Dance",
        "A honeybee that finds a rich patch of flowers returns to the hive and performs a waggle dance on the comb. "
        "The angle of the straight run relative to vertical tells the other bees the direction of the flowers "
        "relative to the sun, and the length of the run tells them the distance. Bees that follow the dance fly out "
        "and find the patch with surprising accuracy. The dance adjusts through the day as the sun moves, so the "
        "bees must also keep track of time.",
    ),
    (
        "tides",
        "Tides",
        "Tides are caused mainly by the Moon's gravity pulling on the oceans. The water nearest the Moon is pulled "
        "a little more than the Earth as a whole, and the water on the far side a little less, so the oceans bulge "
        "on both sides. As the Earth turns, most coasts pass through two bulges a day and see two high tides. When "
        "the Sun and Moon line up, at new and full moon, their pulls add and the tides are largest; these are "
        "called spring tides.",
    ),
    (
        "library",
        "A Small Library",
        "The library in the old schoolhouse opens three afternoons a week and is run entirely by volunteers. It has "
        "about six thousand books, a shelf of seed packets that anyone may borrow and return after harvest, and a "
        "box of tools for fixing bicycles. On Saturdays children read aloud to a patient dog named Biscuit. The "
        "library has no budget for new books, so every volume on its shelves was given by someone in the valley.",
    ),
    (
        "compost",
        "Making Compost",
        "Compost is made by microbes that break down plant material into a dark, crumbly soil conditioner. A good "
        "heap mixes green material, such as grass clippings and vegetable scraps, with brown material, such as dry "
        "leaves and straw, in roughly equal volumes. The heap needs air and should be about as damp as a wrung-out "
        "sponge. Turning it every few weeks lets in oxygen and speeds the process, and a well-kept heap can be "
        "ready in three months.",
    ),
    (
        "bridge",
        "The Stone Bridge",
        "The stone bridge over the river has five arches and has stood for more than six hundred years. Its builders "
        "had no cement that could set underwater, so they built the piers inside timber cofferdams that were pumped "
        "dry by hand. The pointed cutwaters on the upstream side split the current and protect the piers from "
        "floating ice. Cars have crossed it for a century, but the bridge was designed for carts, and lorries are "
        "now sent the long way round.",
    ),
    (
        "batch",
        "Batch Inference",
        "Batch inference runs a language model over many prompts at once instead of answering them one by one as "
        "they arrive. Because nobody is waiting for each answer, the system can group prompts of similar length, "
        "keep the accelerator fully busy and choose the cheapest hardware that finishes in time. The cost of a job "
        "is then mostly the time the device spends computing, so a service that reports tokens per second and "
        "cost per million tokens lets users compare models and settings before they commit to a large run.",
    ),
    (
        "queue",
        "Job Queues",
        "A job queue lets one program hand work to another without waiting for it. The producer writes a small "
        "message describing the work to a broker, and any number of workers take messages off the queue and do "
        "the work. If a worker dies before it acknowledges a message, the broker hands the message to another "
        "worker. This makes the system tolerant of crashes, but it means a task may run twice, so each task should "
        "be written so that running it again does no harm.",
    ),
    (
        "parquet",
        "Columnar Files",
        "A columnar file stores all the values of one column together rather than storing rows one after another. "
        "Reading a single column then touches only that column's bytes, and values of the same type compress well "
        "when they sit side by side. Files are split into row groups, each with its own statistics, so a reader can "
        "skip groups that cannot match a filter. These properties make columnar formats a good fit for large "
        "tables that are written once and read many times.",
    ),
    (
        "kv-cache",
        "The KV Cache",
        "When a transformer generates text one token at a time, each new token attends to every token before it. "
        "Recomputing the keys and values of the earlier tokens at every step would waste most of the work, so "
        "inference engines keep them in a key-value cache. The cache grows with every generated token and often "
        "uses more memory than the model weights. Storing it in fixed-size blocks, like pages of virtual memory, "
        "lets many sequences share the memory without fragmenting it.",
    ),
    (
        "orchard",
        "The Orchard in Winter",
        "In winter the orchard looks asleep, but it is the season of pruning. Each tree is cut back to let light "
        "into the centre and to remove branches that cross or rub. Old varieties grafted onto hardy rootstocks "
        "grow here, some of them no longer sold anywhere else. The prunings are stacked at the edge of the field, "
        "where they shelter hedgehogs and beetles until spring, and the best straight shoots are kept for next "
        "year's grafts.",
    ),
    (
        "clock",
        "The Town Clock",
        "The town clock was installed in the church tower in 1862 and was wound by hand every eight days until "
        "1998. Its mechanism weighs nearly a tonne and is regulated by a pendulum four metres long. A volunteer "
        "checks it against a radio time signal each Sunday and adjusts it by adding or removing small coins from "
        "a tray on the pendulum. The clock is rarely more than a few seconds wrong, which the volunteer considers "
        "a matter of local pride.",
    ),
    (
        "river",
        "River Restoration",
        "For decades the river was straightened and lined with concrete to move floodwater away quickly. The "
        "result was a fast, shallow channel with few fish and worse floods downstream. A restoration project "
        "removed the concrete, let the river meander again and reconnected it to its old flood meadows. Within "
        "five years trout returned to spawn, the meadows stored water in wet winters, and the town downstream saw "
        "its floods peak later and lower.",
    ),
    (
        "chess",
        "Learning Chess",
        "Beginners at chess often try to memorise openings, but most teachers suggest starting with endgames. With "
        "only a few pieces on the board, a student can see clearly how the king becomes a strong piece, how pawns "
        "are promoted and why opposition matters. These ideas carry back into the middle game. Playing many slow "
        "games and reviewing each loss afterwards teaches more than studying long lines of moves that the "
        "opponent will rarely follow.",
    ),
    (
        "snow",
        "Snowflakes",
        "A snowflake begins as a tiny ice crystal forming around a speck of dust high in a cloud. Because water "
        "molecules bond at fixed angles, the crystal grows with six-fold symmetry. The exact shape depends on the "
        "temperature and humidity the crystal passes through as it falls: plates form in some conditions, needles "
        "and columns in others, and the branching stars in between. Since every flake takes a slightly different "
        "path, no two grow quite alike.",
    ),
    (
        "market",
        "The Saturday Market",
        "Every Saturday the square fills with stalls before dawn. Farmers sell vegetables picked the day before, a "
        "baker arrives with bread still warm, and a knife grinder sharpens blades while customers wait. The market "
        "has run for more than three hundred years under a charter that once set fines for short weights. Today "
        "the fines are gone, but traders still use the brass scale kept in the town hall to settle arguments.",
    ),
    (
        "caching",
        "Caching",
        "A cache keeps copies of data that is slow to fetch so that later requests are served quickly. Its "
        "usefulness depends on locality: programs tend to reuse recent data and data stored near it. Every cache "
        "needs a rule for what to evict when it is full, and least recently used is a common choice. The hard part "
        "is keeping copies correct when the original changes, which is why caching is often described as one of "
        "the difficult problems in computing.",
    ),
    (
        "walk",
        "The Coastal Path",
        "The coastal path runs for ninety kilometres between two fishing towns, climbing over headlands and dropping "
        "into coves. Walkers usually take five days, sleeping in farmhouses and old coastguard cottages along the "
        "way. In spring the cliffs are covered with sea pinks, and seals haul out on the rocks below. The path is "
        "maintained by a small team who rebuild steps washed away each winter and repair stiles with oak from a "
        "local wood.",
    ),
]


# (doc_id, title, file in jobs/domain/sample_texts/); the first two are longer than 2048 tokens.
LONG_DOCUMENTS: list[tuple[str, str, str]] = [
    ("freight-design", "How Freight Runs a Batch Job", "freight-design.md"),
    ("harbour-almanac", "The Harbour Town Almanac", "harbour-almanac.md"),
    ("river-survey", "A Survey of the Upper River", "river-survey.md"),
    ("gettysburg", "The Gettysburg Address (Abraham Lincoln, 1863; public domain)", "gettysburg-address.txt"),
]


def long_document_text(file_name: str) -> str:
    """A long sample text without its Markdown title line."""
    text = (files("jobs.domain") / "sample_texts" / file_name).read_text(encoding="utf-8")
    lines = text.splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    return "\n".join(lines).strip()


def all_documents() -> list[tuple[str, str, str]]:
    """(doc_id, title, text): the short documents, then the long ones."""
    long = [(doc_id, title, long_document_text(name)) for doc_id, title, name in LONG_DOCUMENTS]
    return [*DOCUMENTS, *long]


def sample_docs_table(rows: int | None = None) -> pa.Table:
    """`custom_id`, `title`, `text`; the short documents come first. With rows above the number of
    documents they repeat with new ids."""
    documents = all_documents()
    count = rows or len(documents)
    picked = [documents[i % len(documents)] for i in range(count)]
    suffix = [f"-{i // len(documents)}" if i >= len(documents) else "" for i in range(count)]
    return pa.table(
        {
            "custom_id": [doc_id + tail for (doc_id, _, _), tail in zip(picked, suffix, strict=True)],
            "title": [title for _, title, _ in picked],
            "text": [text for _, _, text in picked],
        }
    )


def write_sample_docs(path: Path, rows: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(sample_docs_table(rows), path)
    return path
