"""Hand-written content of the mini AppWorld, arranged into one seeded world.

Everything a task asks about is written here by hand (names, songs, notes, todos,
payments, files); the seed only decides who owns what, so two builds with the same
seed are identical. Pure Python: the builder turns this into AppWorld DB rows.
"""

import dataclasses
import datetime
import random

# The world's clock: base content predates every task.
BASE_TIME = datetime.datetime(2023, 4, 2, 9, 30)
TASK_TIME = datetime.datetime(2023, 5, 18, 12, 0)

# (first name, last name, birthday, sex); the first two are the supervisors.
PEOPLE = (
  ("Joyce", "Weaver", "1989-03-14", "female"),
  ("Omar", "Haddad", "1991-11-02", "male"),
  ("Lena", "Fischer", "1990-07-21", "female"),
  ("Marcus", "Bell", "1987-01-09", "male"),
  ("Priya", "Raman", "1993-05-30", "female"),
  ("Daniel", "Okafor", "1985-09-17", "male"),
  ("Sofia", "Moreno", "1994-02-11", "female"),
  ("Kenji", "Watanabe", "1988-12-05", "male"),
  ("Hannah", "Brooks", "1996-08-23", "female"),
  ("Tomas", "Novak", "1982-04-28", "male"),
  ("Grace", "Liu", "1992-10-14", "female"),
  ("Elijah", "Carter", "1990-06-03", "male"),
  ("Nadia", "Petrova", "1986-03-19", "female"),
  ("Samuel", "Greene", "1979-11-30", "male"),
  ("Aisha", "Bello", "1995-01-25", "female"),
  ("Victor", "Alvarez", "1983-07-08", "male"),
)
NUM_SUPERVISORS = 2

# Relationships of a supervisor's phone contacts, in the order of the other people.
# manager, landlord and roommate are held by exactly one contact each.
RELATIONSHIPS = (
  "sibling", "friend", "coworker", "manager", "friend", "landlord", "coworker",
  "cousin", "friend", "roommate", "coworker", "friend", "parent", "coworker", "friend",
)
UNIQUE_RELATIONSHIPS = ("manager", "landlord", "roommate")

# artist -> (genre, album, [(song title, duration in seconds)])
CATALOG = {
  "The Lanterns": ("rock", "Harbor Lights", [
    ("Northern Road", 242), ("Paper Boats", 198), ("Static Summer", 231),
    ("Last Ferry Home", 265)]),
  "Mila Hart": ("pop", "Glass Hearts", [
    ("Neon Promise", 187), ("Golden Hour Call", 204), ("Run To You Tonight", 176),
    ("Sugar Rain", 193)]),
  "Blue Hour Trio": ("jazz", "After the Rain", [
    ("Smoke and Velvet", 311), ("Midnight in Alfama", 289), ("Slow Tram", 274),
    ("Cobblestone Waltz", 256)]),
  "Orchestra Lumen": ("classical", "Winter Suites", [
    ("Nocturne in Grey", 402), ("Frost Prelude", 356), ("Canon of Candles", 377)]),
  "Dusty Boots": ("country", "Long Way West", [
    ("Porch Light", 215), ("Gravel and Gold", 228), ("Whiskey Creek", 203),
    ("Heartland Radio", 219)]),
  "KAIRO": ("electronic", "Pulse Theory", [
    ("Voltage Bloom", 248), ("Night Transit", 267), ("Chrome Tides", 239),
    ("Satellite Hearts", 251)]),
  "Verse Nine": ("hip-hop", "City Ledger", [
    ("Block Letters", 201), ("Skyline Ledger", 214), ("Rent Day", 188),
    ("Corner Store Kings", 222)]),
  "Willow & Finch": ("folk", "Quiet Acres", [
    ("Apple Orchard", 196), ("Lantern Song", 208), ("River Stones", 183),
    ("Barn Dance Sunday", 212)]),
  "Static Avenue": ("rock", "Overpass", [
    ("Concrete Garden", 236), ("Fuse Box", 191), ("Turnpike Echo", 247)]),
  "Luna Vega": ("pop", "Starlit Diaries", [
    ("Postcard Love", 181), ("Cherry Skyline", 199), ("Dancing in Lowercase", 205)]),
}
LIBRARY_SIZE = 24
PLAYLISTS = ("Morning Run", "Rainy Sunday", "Road Trip 2023", "Focus Mode")
PLAYLIST_SIZE = (5, 8)

# (description, amount) of Venmo payments between friends.
PAYMENTS = (
  ("Pizza night", 18.50), ("Concert tickets", 64.00), ("Uber to the airport", 23.75),
  ("Groceries", 41.20), ("Birthday gift for Mom", 30.00), ("Movie and popcorn", 16.25),
  ("Brunch at Lucia's", 27.40), ("Electric bill share", 38.60), ("Climbing gym pass", 22.00),
  ("Book club snacks", 12.80), ("Camping gear rental", 55.00), ("Coffee beans", 14.50),
  ("Taxi home", 19.30), ("Farmers market", 26.10), ("Wedding gift pool", 75.00),
  ("Board game night", 11.40),
)
VENMO_FRIENDS = 8
PAYMENTS_PER_FRIEND = (2, 4)
VENMO_BALANCE = 850.0

# (title, tags, content) of Simple Note notes.
NOTES = (
  ("Grocery list", ["shopping"], "- oat milk\n- eggs\n- spinach\n- sourdough bread"),
  ("Banana bread", ["recipes"], "3 ripe bananas, 1/3 cup melted butter, 3/4 cup sugar, "
   "1 egg, 1 tsp vanilla, 1 tsp baking soda, 1.5 cups flour. Bake 60 min at 350F."),
  ("Lentil soup", ["recipes"], "Red lentils, carrots, onion, cumin, lemon. Simmer 25 min."),
  ("Weeknight curry", ["recipes"], "Chickpeas, coconut milk, curry paste, spinach, rice."),
  ("Lisbon itinerary", ["travel"], "Day 1: Alfama and the castle. Day 2: Belem. "
   "Day 3: Sintra day trip."),
  ("Packing checklist", ["travel", "shopping"], "passport, adapters, rain jacket, "
   "walking shoes, sunscreen"),
  ("Kyoto temples", ["travel"], "Fushimi Inari early morning, Kinkaku-ji, Ginkaku-ji, "
   "the philosopher's path."),
  ("Q3 planning notes", ["work"], "Hiring: two backend roles. Launch beta in August. "
   "Budget review on the 14th."),
  ("1:1 agenda", ["work"], "Career goals, feedback on the launch, vacation dates."),
  ("Standup template", ["work"], "Yesterday / Today / Blockers"),
  ("App ideas", ["ideas"], "Plant watering reminder; shared grocery list; "
   "bus arrival widget."),
  ("Gift ideas", ["ideas", "shopping"], "Mom: gardening gloves. Dad: a jazz record. "
   "Sam: climbing chalk bag."),
  ("Books to read", ["books"], "The Overstory; Piranesi; A Gentleman in Moscow; "
   "Project Hail Mary"),
  ("Reading notes: Piranesi", ["books"], "The House is beautiful beyond measure; "
   "kindness is infinite."),
  ("Hardware store", ["shopping"], "wood screws, sandpaper 120 grit, picture hooks"),
  ("Pancakes", ["recipes"], "1 cup flour, 1 tbsp sugar, 2 tsp baking powder, 1 cup milk, "
   "1 egg, 2 tbsp butter."),
  ("Running log", ["health"], "Mon 5k 27:40, Wed 8k 45:10, Sat 12k 1:08:30"),
  ("Doctor questions", ["health"], "Ask about the knee; renew the allergy prescription."),
  ("Garden plan", ["ideas"], "Tomatoes along the fence, basil in pots, "
   "move the lavender to the sunny corner."),
  ("Wifi and door codes", ["home"], "Guest wifi: lanternhouse / door code 4417"),
)
NUM_NOTES = 16

# project -> [(task title, priority)]
PROJECTS = {
  "Home renovation": [
    ("Get three quotes for the kitchen floor", "high"), ("Pick paint colors", "medium"),
    ("Fix the squeaky bedroom door", "low"), ("Replace the bathroom fan", "medium"),
    ("Order new cabinet handles", "low"), ("Book the electrician", "high")],
  "Trip to Lisbon": [
    ("Book flights", "high"), ("Reserve the hotel in Alfama", "high"),
    ("Buy a travel adapter", "low"), ("Plan the Sintra day trip", "medium"),
    ("Exchange some euros", "low")],
  "Q3 planning": [
    ("Draft the hiring plan", "high"), ("Review the budget spreadsheet", "medium"),
    ("Schedule the launch retro", "medium"), ("Write the beta announcement", "high"),
    ("Update the team roadmap", "low"), ("Collect OKR drafts", "medium")],
  "Garden": [
    ("Buy tomato seedlings", "medium"), ("Build the raised bed", "high"),
    ("Fix the hose reel", "low"), ("Mulch the flower beds", "low")],
}
PROJECT_COLORS = ("blue", "green", "orange", "red")
COMPLETED_FRACTION = 0.35

# directory (under the home) -> [(file name, content)]
FILES = {
  "documents": [
    ("resume.pdf", "Resume: ten years of product work, references on request."),
    ("lease_agreement.pdf", "Residential lease, 12 months, rent due on the 1st."),
    ("meeting_notes.txt", "Action items: send the deck, book the room, follow up."),
    ("budget_2023.xlsx", "Month,Rent,Food,Transport\nJan,1450,520,110"),
    ("cover_letter.docx", "Dear hiring manager, I am excited to apply."),
  ],
  "documents/receipts": [
    ("laptop_receipt.pdf", "Laptop 14in, $1,249.00, paid by card ending 4417."),
    ("dentist_receipt.pdf", "Cleaning and checkup, $180.00."),
    ("groceries_march.txt", "Groceries March: $412.35 over 9 trips."),
    ("bike_repair.pdf", "Bike tune-up and new chain, $95.00."),
  ],
  "photos": [
    ("beach_sunset.jpg", "jpeg image, 4032x3024"), ("birthday_cake.jpg", "jpeg image"),
    ("passport_scan.png", "png image"), ("garden_before.jpg", "jpeg image"),
  ],
  "photos/2022": [
    ("kyoto_temple.jpg", "jpeg image"), ("lisbon_tram.jpg", "jpeg image"),
    ("family_dinner.png", "png image"), ("hiking_trail.jpg", "jpeg image"),
    ("new_year.jpg", "jpeg image"),
  ],
  "downloads": [
    ("train_tickets.pdf", "Porto to Lisbon, seat 42A."), ("podcast_episode.mp3", "audio"),
    ("setup_guide.txt", "Hold the reset button for ten seconds."),
    ("recipes_collection.pdf", "Forty weeknight recipes."), ("invoice_7781.pdf", "Invoice 7781"),
  ],
  "music": [
    ("demo_track.mp3", "audio"), ("voice_memo.m4a", "audio"), ("lyrics_draft.txt",
     "Verse one: the harbor lights are calling."),
  ],
}
MIN_FILES_PER_DIRECTORY = 3  # a supervisor holds 3 to all of a directory's files


@dataclasses.dataclass(frozen=True)
class Person:
  first_name: str
  last_name: str
  birthday: str
  sex: str
  email: str
  phone_number: str
  password: str  # one password for all of a person's app accounts

  @property
  def name(self) -> str:
    return f"{self.first_name} {self.last_name}"


@dataclasses.dataclass(frozen=True)
class Song:
  title: str
  artist: str
  album: str
  genre: str
  duration: int


@dataclasses.dataclass(frozen=True)
class Payment:
  sender: str  # email
  receiver: str  # email
  amount: float
  description: str
  day: int  # days after BASE_TIME


@dataclasses.dataclass(frozen=True)
class Todo:
  title: str
  priority: str
  completed: bool


@dataclasses.dataclass(frozen=True)
class Holdings:
  """What one supervisor owns across the apps."""
  contacts: tuple[tuple[str, str], ...]  # (email, relationship)
  library: tuple[str, ...]  # song titles
  playlists: dict[str, tuple[str, ...]]  # title -> song titles
  payments: tuple[Payment, ...]
  notes: tuple[tuple[str, tuple[str, ...], str], ...]  # (title, tags, content)
  projects: dict[str, tuple[Todo, ...]]
  files: dict[str, tuple[tuple[str, str], ...]]  # directory -> ((name, content), ...)


@dataclasses.dataclass(frozen=True)
class World:
  people: tuple[Person, ...]
  songs: tuple[Song, ...]
  holdings: dict[str, Holdings]  # supervisor email -> holdings

  @property
  def supervisors(self) -> tuple[Person, ...]:
    return self.people[:NUM_SUPERVISORS]

  def person(self, email: str) -> Person:
    return next(p for p in self.people if p.email == email)

  def song(self, title: str) -> Song:
    return next(s for s in self.songs if s.title == title)


_PASSWORD_WORDS = ("harbor", "maple", "comet", "velvet", "tundra", "saffron", "orbit",
                   "juniper", "cobalt", "meadow", "ember", "lagoon")


def _person(index: int, rng: random.Random) -> Person:
  first, last, birthday, sex = PEOPLE[index]
  words = rng.sample(_PASSWORD_WORDS, 2)
  return Person(
    first_name=first, last_name=last, birthday=birthday, sex=sex,
    email=f"{first.lower()}.{last.lower()}@gmail.com",
    phone_number=f"{rng.randint(201, 989)}{rng.randint(200, 999)}{rng.randint(1000, 9999)}",
    password=f"{words[0]}-{words[1]}-{rng.randint(10, 99)}",
  )


def _holdings(supervisor: Person, people: tuple[Person, ...], songs: tuple[Song, ...],
              rng: random.Random) -> Holdings:
  others = [p for p in people if p.email != supervisor.email]
  contacts = tuple((p.email, rel) for p, rel in zip(others, RELATIONSHIPS, strict=True))
  library = tuple(s.title for s in rng.sample(songs, LIBRARY_SIZE))
  playlists = {title: tuple(rng.sample(library, rng.randint(*PLAYLIST_SIZE)))
               for title in rng.sample(PLAYLISTS, 3)}
  payments = []
  for friend in rng.sample(others, VENMO_FRIENDS):
    for _ in range(rng.randint(*PAYMENTS_PER_FRIEND)):
      description, amount = rng.choice(PAYMENTS)
      sender, receiver = supervisor.email, friend.email
      if rng.random() < 0.5:
        sender, receiver = receiver, sender
      payments.append(Payment(sender, receiver, amount, description, rng.randint(0, 40)))
  notes = tuple((t, tuple(tags), c) for t, tags, c in rng.sample(NOTES, NUM_NOTES))
  projects = {
    name: tuple(Todo(title, priority, rng.random() < COMPLETED_FRACTION)
                for title, priority in todos)
    for name, todos in PROJECTS.items()}
  files = {}
  for directory, entries in FILES.items():
    count = rng.randint(MIN_FILES_PER_DIRECTORY, len(entries))
    files[directory] = tuple(rng.sample(entries, count))
  return Holdings(contacts, library, playlists, tuple(payments), notes, projects, files)


def make_world(seed: int) -> World:
  """The whole mini world for one seed."""
  rng = random.Random(seed)
  people = tuple(_person(i, rng) for i in range(len(PEOPLE)))
  songs = tuple(Song(title, artist, album, genre, duration)
                for artist, (genre, album, tracks) in CATALOG.items()
                for title, duration in tracks)
  holdings = {s.email: _holdings(s, people, songs, rng) for s in people[:NUM_SUPERVISORS]}
  return World(people, songs, holdings)
